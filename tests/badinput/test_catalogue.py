"""The bad-input catalogue runner: every ``Case`` of every ``tests/badinput/cases_*.py`` as a real subprocess.

Schema and promises: ``tests/badinput/cases.py``. Run it with ``pytest tests/badinput`` (one case:
``pytest tests/badinput -k <case-id>``). Design, for speed on a small CPU box:

- the shared workspace (``data``, ``ckpt``, ``hf``, ``server``) is built once per session in a temp dir, only the
  parts that the *selected* cases ``need``, in a background thread while the cases that need nothing already run;
- a session fixture starts every selected case in a pool of :data:`WORKERS` threads (one subprocess each) and hands
  back futures; one parametrized test per case (pytest id = the case id) waits for its own future and asserts, so
  failures stay per case and readable (the command, the cwd and the tail of the output are printed);
- the runner's wall time and the slowest cases are printed at the end of the session.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the cases modules are imported as tests.badinput.cases_*
    sys.path.insert(0, str(REPO))

from tests.badinput.cases import TINY_FLAGS, Case  # noqa: E402

WORKERS = int(os.environ.get("BADINPUT_WORKERS", "3"))
"""Cases run at once (each a subprocess of a few CPU seconds, mostly ``import torch``)."""
PARTS = ("data", "ckpt", "hf", "server")
TAIL_LINES = 40
SERVER_START_TIMEOUT = 180.0
CASE_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}
ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


# ----------------------------------------------------------------------------------------------- collection


def _collect() -> tuple[list[tuple[str, Case]], list[tuple[str, str]]]:
    """``([(module, case), ...], [(module, import error), ...])`` over every ``cases_*.py`` beside this file."""
    cases: list[tuple[str, Case]] = []
    broken: list[tuple[str, str]] = []
    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        name = f"tests.badinput.{path.stem}"
        try:
            module = importlib.import_module(name)
            found = module.CASES
        except Exception as err:  # one broken module must not hide every other area's cases
            broken.append((path.name, f"{type(err).__name__}: {err}"))
            continue
        cases.extend((path.name, case) for case in found)
    return cases, broken


CASES, BROKEN = _collect()


def _case_problems(case: Any) -> list[str]:
    """What is wrong with one catalogue entry (empty: nothing)."""
    problems = []
    for attr in ("id", "argv", "exit_code", "message", "unchanged", "needs", "setup", "timeout"):
        if not hasattr(case, attr):
            return [f"not a Case (no '{attr}')"]
    if not ID_RE.match(str(case.id)):
        problems.append(f"id {case.id!r} is not kebab-case")
    if not isinstance(case.argv, tuple) or not case.argv:
        problems.append("argv must be a non-empty tuple")
    if not isinstance(case.exit_code, int) or case.exit_code == 0:
        problems.append(f"exit_code must be a non-zero int; got {case.exit_code!r}")
    if not case.message:
        problems.append("message must not be empty")
    unknown = sorted(set(case.needs) - set(PARTS))
    if unknown:
        problems.append(f"unknown needs {unknown}; use any of {list(PARTS)}")
    return problems


# ------------------------------------------------------------------------------------------------ subprocesses


def _env() -> dict[str, str]:
    return {**os.environ, **CASE_ENV}


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _run(
    argv: list[str], timeout: float, stdin: str | None = None
) -> tuple[int | None, str, float]:
    """``(exit code or None when it hung, stdout + stderr, seconds)``; a hung command's whole process group is
    killed (ranks and helpers it spawned included)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=_env(),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(input=stdin, timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        code = None
    return code, out or "", time.monotonic() - start


def _kill_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    try:
        if grace:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
                return
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------------------------------------- "unchanged"


def _digest(path: Path) -> Any:
    """A comparable snapshot of ``path``: None (absent), a file's sha256, or a directory's ``{relpath: ...}``
    (files by content, symlinks by target, empty directories too), so added and removed files show."""
    if path.is_symlink():
        return ("link", os.readlink(path))
    if not path.exists():
        return None
    if path.is_file():
        return _sha256(path)
    snap: dict[str, Any] = {}
    for root, dirs, files in os.walk(path):
        base = Path(root)
        for d in dirs:
            p = base / d
            snap[str(p.relative_to(path))] = ("link", os.readlink(p)) if p.is_symlink() else "dir"
        for f in files:
            p = base / f
            rel = str(p.relative_to(path))
            snap[rel] = ("link", os.readlink(p)) if p.is_symlink() else _sha256(p)
    return snap


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _diff(before: Any, after: Any) -> str:
    """What changed between two :func:`_digest` snapshots, in words."""
    if isinstance(before, dict) and isinstance(after, dict):
        added = sorted(set(after) - set(before))
        removed = sorted(set(before) - set(after))
        changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
        parts = [
            f"{what} {names[:5]}"
            for what, names in (("added", added), ("removed", removed), ("changed", changed))
            if names
        ]
        return "; ".join(parts)
    describe = {None: "absent"}
    return (
        f"{describe.get(before, 'present')} before, {describe.get(after, 'present')} after"
        if (before is None) != (after is None)
        else "its bytes changed"
    )


# --------------------------------------------------------------------------------------------- the workspace


class Workspace:
    """The shared read-only inputs, each part built at most once, in the background, on first demand."""

    DIRS = {"data": "tiny", "ckpt": "ckpt", "hf": "hf"}

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self._server: subprocess.Popen | None = None
        self._done: dict[str, threading.Event] = {p: threading.Event() for p in PARTS}
        self._error: dict[str, str] = {}
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self.seconds: dict[str, float] = {}
        self.digests: dict[str, Any] = {}

    def start(self, parts: set[str]) -> None:
        """Begin building ``parts`` (and what they depend on) in a background thread."""
        order = [p for p in PARTS if p in parts or (p == "ckpt" and parts & {"hf", "server"})]
        with self._lock:
            order = [p for p in order if p not in self._started]
            self._started.update(order)
        if order:
            threading.Thread(target=self._build_all, args=(order,), daemon=True).start()

    def wait(self, parts: tuple[str, ...]) -> str | None:
        """Block until ``parts`` are built; the first part's build error, else None."""
        self.start(set(parts))
        for p in parts:
            self._done[p].wait()
            if p in self._error:
                return f"workspace part '{p}' could not be built:\n{self._error[p]}"
        return None

    def _build_all(self, order: list[str]) -> None:
        threads = []
        for p in order:
            if p in ("hf", "server"):  # both only read the checkpoint: build them side by side
                threads.append(threading.Thread(target=self._build, args=(p,), daemon=True))
                threads[-1].start()
            else:
                self._build(p)
        for t in threads:
            t.join()

    def _build(self, part: str) -> None:
        start = time.monotonic()
        try:
            if part != "data" and part != "ckpt" and (err := self.wait(("ckpt",))):
                raise RuntimeError(err)
            getattr(self, f"_build_{part}")()
            if part in self.DIRS:
                self.digests[part] = _digest(self.root / self.DIRS[part])
        except Exception as err:
            self._error[part] = f"{type(err).__name__}: {err}"
        finally:
            self.seconds[part] = time.monotonic() - start
            self._done[part].set()

    def _build_data(self) -> None:
        shutil.copytree(REPO / "tests" / "fixtures" / "tiny", self.root / self.DIRS["data"])

    def _build_ckpt(self) -> None:
        argv = [
            sys.executable,
            "pretrain_gpt.py",
            *TINY_FLAGS,
            "--train-iters",
            "2",
            "--save",
            str(self.root / "ckpt"),
        ]
        self._check(argv, 300)

    def _build_hf(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "tools.checkpoint.trident_to_hf",
            "--load",
            str(self.root / "ckpt"),
            "--out",
            str(self.root / "hf"),
            "--no-verify",
            "--no-progress",
        ]
        self._check(argv, 300)

    @staticmethod
    def _check(argv: list[str], timeout: float) -> None:
        code, out, _ = _run(argv, timeout)
        if code != 0:
            raise RuntimeError(f"{' '.join(argv)} -> exit {code}\n{_tail(out)}")

    def _build_server(self) -> None:
        """The server on a port of its own choosing (``--port 0``), read back from its first stdout line."""
        log = self.root / "server.log"
        argv = [
            sys.executable,
            "tools/run_text_generation_server.py",
            "--load",
            str(self.root / "ckpt"),
            "--device",
            "cpu",
            "--port",
            "0",
        ]
        with open(log, "w") as sink:
            self._server = subprocess.Popen(
                argv,
                cwd=REPO,
                env=_env(),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            m = re.search(r"serving PUT (http://\S+?)/api", log.read_text(errors="replace"))
            if m and self._healthy(m.group(1)):
                self.url = m.group(1)
                return
            if self._server.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(
            f"{' '.join(argv)} did not start\n{_tail(log.read_text(errors='replace'))}"
        )

    @staticmethod
    def _healthy(url: str) -> bool:
        """A GET of the API answers (405, JSON): the server accepts and serves connections."""
        try:
            urllib.request.urlopen(f"{url}/api", timeout=5).close()
        except urllib.error.HTTPError as err:
            return err.code == 405
        except OSError:
            return False
        return False

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            _kill_group(self._server, grace=10.0)


# -------------------------------------------------------------------------------------------------- running


@dataclass
class Result:
    """One case's outcome: the command as run, and what came back."""

    argv: list[str]
    code: int | None = None
    output: str = ""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def _fill(text: str, values: dict[str, str]) -> str:
    return text.format(**values)


def _run_case(case: Case, ws: Workspace, tmp: Path) -> Result:
    result = Result(argv=[sys.executable, *case.argv])
    err = ws.wait(tuple(case.needs))
    if err:
        result.problems.append(err)
        return result
    tmp.mkdir(parents=True, exist_ok=True)
    port = ws.url.rsplit(":", 1)[-1] if ws.url else ""
    values = {"tmp": str(tmp), "ws": str(ws.root), "repo": str(REPO), "url": ws.url, "port": port}
    try:
        result.argv = [sys.executable, *(_fill(a, values) for a in case.argv)]
        message = _fill(case.message, values)
        unchanged = [Path(_fill(u, values)) for u in case.unchanged]
        if case.setup is not None:
            case.setup(tmp, ws.root)
        before = {p: _digest(p) for p in unchanged}
    except Exception as exc:  # a broken case definition is that case's failure, not the session's
        result.problems.append(f"the case's set-up failed: {type(exc).__name__}: {exc}")
        return result
    stdin = getattr(case, "stdin", None)
    result.code, result.output, result.seconds = _run(result.argv, case.timeout, stdin)
    if result.code is None:
        result.problems.append(f"hung: still running after {case.timeout:.0f} s (killed)")
    elif result.code != case.exit_code:
        result.problems.append(f"exit code {result.code}, expected {case.exit_code}")
    if message not in result.output:
        result.problems.append(f"message fragment {message!r} not in the output")
    if "Traceback" in result.output:
        result.problems.append("a Traceback in the output")
    for p, digest in before.items():
        now = _digest(p)
        if now != digest:
            result.problems.append(f"{p} changed: {_diff(digest, now)}")
    return result


@dataclass
class Session:
    ws: Workspace
    futures: dict[int, Future] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


def _selected(request: pytest.FixtureRequest) -> list[int]:
    """Indices into :data:`CASES` of this session's selected catalogue tests (``-k`` selects fewer)."""
    return [
        item.callspec.params["index"]
        for item in request.session.items
        if getattr(item, "callspec", None) is not None
        and item.module is sys.modules[__name__]
        and "index" in item.callspec.params
    ]


@pytest.fixture(scope="session")
def catalogue(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Session]:
    root = tmp_path_factory.mktemp("badinput")
    (root / "ws").mkdir()
    session = Session(ws=Workspace(root / "ws"))
    selected = _selected(request)
    session.ws.start({p for i in selected for p in CASES[i][1].needs})
    # Cases that need nothing start first, so the pool works while the workspace builds.
    order = sorted(
        selected, key=lambda i: max((PARTS.index(p) + 1 for p in CASES[i][1].needs), default=0)
    )
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="badinput")
    for i in order:
        case = CASES[i][1]
        session.futures[i] = pool.submit(
            _run_case, case, session.ws, root / "cases" / f"{i:03d}-{case.id}"
        )
    try:
        yield session
    finally:
        for f in session.futures.values():
            f.cancel()
        pool.shutdown(wait=True)
        session.ws.close()
        _summary(request, session)


def _summary(request: pytest.FixtureRequest, session: Session) -> None:
    done = [
        (f.result(), CASES[i][1].id)
        for i, f in session.futures.items()
        if f.done() and not f.cancelled()
    ]
    if not done:
        return
    wall = time.monotonic() - session.started
    slowest = sorted(done, key=lambda rc: -rc[0].seconds)[:5]
    builds = ", ".join(f"{p} {s:.1f} s" for p, s in session.ws.seconds.items())
    lines = [
        f"bad-input catalogue: {len(done)} cases in {wall:.1f} s wall ({WORKERS} at a time; "
        f"workspace: {builds or 'none'})",
        "slowest: " + ", ".join(f"{cid} {r.seconds:.1f} s" for r, cid in slowest),
    ]
    key = next(
        (
            m.SUMMARY_KEY
            for name, m in list(sys.modules.items())
            if name.endswith("badinput.conftest") and hasattr(m, "SUMMARY_KEY")
        ),
        None,
    )
    if key is not None:  # printed at the end by conftest.pytest_terminal_summary
        request.config.stash[key] = lines


# ---------------------------------------------------------------------------------------------------- tests


def test_catalogue_is_well_formed() -> None:
    """Every ``cases_*.py`` imports, ids are unique and kebab-case, every entry is a usable Case."""
    problems = [f"{mod}: cannot import it ({err})" for mod, err in BROKEN]
    seen: dict[str, str] = {}
    for mod, case in CASES:
        problems += [f"{mod}: {getattr(case, 'id', case)!r}: {p}" for p in _case_problems(case)]
        cid = getattr(case, "id", None)
        if cid in seen:
            problems.append(f"{mod}: duplicate id {cid!r} (also in {seen[cid]})")
        seen.setdefault(cid, mod)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for _, c in CASES])
def test_bad_input(index: int, catalogue: Session) -> None:
    module, case = CASES[index]
    result: Result = catalogue.futures[index].result()
    if result.problems:
        pytest.fail(
            f"{module}::{case.id}: " + "; ".join(result.problems) + "\n"
            f"command (cwd {REPO}): {' '.join(result.argv)}\n"
            f"exit {result.code} after {result.seconds:.1f} s; output tail:\n{_tail(result.output)}",
            pytrace=False,
        )


def test_workspace_untouched(catalogue: Session) -> None:
    """No case wrote into the shared workspace (a case that needs a modified input copies it to ``{tmp}``), and
    the shared server logged no traceback while the cases talked to it."""
    for f in catalogue.futures.values():
        f.result()
    ws = catalogue.ws
    changed = [
        f"{ws.root / ws.DIRS[p]}: {_diff(d, now)}"
        for p, d in ws.digests.items()
        if (now := _digest(ws.root / ws.DIRS[p])) != d
    ]
    log = ws.root / "server.log"
    if log.exists() and "Traceback" in (text := log.read_text(errors="replace")):
        changed.append(f"the shared server logged a traceback:\n{_tail(text)}")
    assert not changed, "\n".join(changed)
