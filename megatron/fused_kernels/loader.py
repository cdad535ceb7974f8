"""Finding the compiled kernels: the extension ``setup.py`` built, else a JIT build into a per-user cache.

Order, once per process and device type (``cpu`` / ``cuda``):

1. ``TRIDENT_NO_KERNELS=1``: no kernels, the PyTorch references run (``reference.py``).
2. The extension built at install (``megatron.fused_kernels._cpu`` / ``_cuda``; ``TRIDENT_PREBUILT_KERNELS=0``
   skips it).
3. A JIT build of ``csrc/cpu/*.cpp`` (or ``csrc/cuda/*.cu`` + binding) with ninja
   (``torch.utils.cpp_extension.load``) into ``$TRIDENT_KERNEL_CACHE`` (default
   ``$XDG_CACHE_HOME/trident/kernels``, i.e. ``~/.cache/trident/kernels``), in a folder named by a hash of the
   sources, flags, GPU architectures (``cuda_arch``), torch and Python versions.

Many processes may start at once (8 ranks per node, several nodes, with or without a shared filesystem). No rank
waits for another rank's build: each process takes an ``flock`` on ``<folder>.lock`` in the cache (so one process
per node compiles and the others then find the result; a waiter logs who holds it and gives up after a bounded time,
``build_cache``), builds in a private staging folder, records the library's size and sha256 in it and renames it
into place; a rename that loses to another node's identical build is dropped, and a library its record does not
vouch for (cut short) is rebuilt, never opened. Any failure (no compiler, no ninja, a compile error, whose whole
output is kept in ``<folder>.log``, a lock held too long, a build folder's name taken by a file, a CPU without the
instructions the prebuilt extension was compiled for) is one warning and the reference path, never a crash: the
kernels are a speed-up, and a cache problem must not stop a run. One log line says which path each device type uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import socket
import sys
from pathlib import Path
from types import ModuleType

from megatron.fused_kernels import build_cache
from megatron.log import log_rank_0

logger = logging.getLogger(__name__)

NO_KERNELS_ENV = "TRIDENT_NO_KERNELS"
PREBUILT_ENV = "TRIDENT_PREBUILT_KERNELS"
"""``0``: ignore the extensions built at install and go straight to the JIT build (to test that path)."""
CACHE_ENV = "TRIDENT_KERNEL_CACHE"
FLAVOUR_ENV = "TRIDENT_CPU_FLAVOUR"
"""``default`` / ``avx2`` / ``avx512``: build the CPU extension for that instruction set instead of the host's widest
(e.g. ``avx2`` for an install shared by CPUs of two generations)."""
PREBUILT = {"cpu": "megatron.fused_kernels._cpu", "cuda": "megatron.fused_kernels._cuda"}
JIT_NAMES = {"cpu": "trident_cpu_kernels", "cuda": "trident_cuda_kernels"}

_status: dict[str, str] = {}
_modules: dict[str, ModuleType | None] = {}
compiled_in_this_process: list[str] = []
"""Names of the extensions this process compiled itself (not loaded from the cache): one entry per real build."""


def csrc_dir() -> Path:
    """``csrc/`` of the checkout this package was installed from (editable installs and source trees)."""
    return Path(__file__).resolve().parents[2] / "csrc"


FLAVOURS = ("default", "avx2", "avx512")
"""The CPU extension's instruction sets, each needing the one before it; ``avx512`` is ATen's AVX512 level."""
_FLAVOUR_CPU_FLAGS = {
    "default": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
}
_FLAVOUR_CFLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
    ],
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split())


def host_flavour() -> str:
    """The widest flavour this CPU runs: ``avx512`` only where torch's own kernels use AVX512 too (its
    ``ATEN_CPU_CAPABILITY`` setting is obeyed), then ``avx2``, else ``default`` (portable)."""
    have = _cpu_flags()
    usable = [f for f in FLAVOURS if _FLAVOUR_CPU_FLAGS[f] <= have]
    best = usable[-1]
    if best == "avx512":
        import torch

        if "AVX512" not in torch.backends.cpu.get_cpu_capability():
            best = "avx2"
    return best


def host_runs(flavour: str) -> bool:
    """True where this CPU has the instructions of ``flavour`` (False for an unknown flavour)."""
    return flavour in _FLAVOUR_CPU_FLAGS and _FLAVOUR_CPU_FLAGS[flavour] <= _cpu_flags()


def build_flavour() -> str:
    """The flavour to build the CPU extension for: ``$TRIDENT_CPU_FLAVOUR``, else ``host_flavour()``.

    Raises ValueError for an unknown name or one this CPU cannot run (the extension must load where it is built)."""
    wanted = os.environ.get(FLAVOUR_ENV, "").strip()
    if not wanted:
        return host_flavour()
    if wanted not in FLAVOURS:
        raise ValueError(f"{FLAVOUR_ENV}={wanted!r} is not one of {', '.join(FLAVOURS)}")
    if not host_runs(wanted):
        lacks = " ".join(sorted(_FLAVOUR_CPU_FLAGS[wanted] - _cpu_flags()))
        raise ValueError(
            f"{FLAVOUR_ENV}={wanted}: this CPU lacks {lacks}; use one of {', '.join(FLAVOURS)} it has"
        )
    return wanted


def cpu_cflags(flavour: str | None = None) -> list[str]:
    """Compiler flags of the CPU extension for ``flavour`` (default: ``build_flavour()``)."""
    # -fopenmp: at::parallel_for runs in parallel only where _OPENMP is defined (the runtime is torch's libgomp);
    # the C++ standard is the one torch.utils.cpp_extension picks for its headers
    return ["-O3", "-fopenmp", *_FLAVOUR_CFLAGS[flavour or build_flavour()]]


CPU_LDFLAGS = ["-fopenmp"]


def sources(kind: str, root: Path | None = None) -> list[Path]:
    """The source files of the ``cpu`` or ``cuda`` extension (empty when ``csrc/`` is not there)."""
    base = (root or csrc_dir()) / kind
    if kind == "cpu":
        return sorted(base.glob("*.cpp"))
    return sorted(base.glob("*.cu")) + sorted(base.glob("*.cpp"))


def default_cache_root() -> Path:
    """``$TRIDENT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/trident/kernels`` (``~/.cache`` by default)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trident" / "kernels"


def headers(srcs: list[Path]) -> list[Path]:
    """The headers beside ``srcs`` (what they may include)."""
    return sorted({h for src in srcs for h in src.parent.glob("*.h")})


def sources_digest(srcs: list[Path]) -> str:
    """A hash of the names and contents of ``srcs`` and their headers."""
    digest = hashlib.sha256()
    for path in [*srcs, *headers(srcs)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_key(name: str, srcs: list[Path], flags: list[str], *, arch: str = "") -> str:
    """A folder name that changes with the sources, the flags, the GPU architectures (``arch``: what a CUDA build
    compiles for, :func:`cuda_arch`; empty for a CPU build), torch and Python."""
    import torch

    digest = hashlib.sha256()
    parts = (name, torch.__version__, str(torch.version.cuda), arch, sys.version, " ".join(flags))
    for part in (*parts, sources_digest(srcs)):
        digest.update(part.encode() + b"\0")
    return f"{name}-{digest.hexdigest()[:16]}"


ARCH_ENV = "TORCH_CUDA_ARCH_LIST"


def cuda_arch(
    env: str | None, capabilities: list[tuple[int, int]], torch_archs: list[str]
) -> tuple[str, list[str]]:
    """What a CUDA JIT build compiles for: ``(arch list, nvcc flags)``.

    ``$TORCH_CUDA_ARCH_LIST`` (``env``) when set: torch reads it itself (no flags added). Unset (or ``native``):
    torch's own rule, made explicit so that the cache key holds it: the visible devices' ``capabilities``, each
    capped at the newest ``sm_XY`` of ``torch_archs`` (``torch.cuda.get_arch_list()``), sorted, PTX for the last
    (``[(8, 0), (9, 0)]`` -> ``8.0;9.0+PTX``), passed as ``-gencode`` flags. Without this the key was the same for
    every GPU generation, and one generation's build was loaded on another.
    """
    if env and env.strip() and env.strip() != "native":
        return " ".join(env.split()), []
    supported = [
        (int(a[3:-1]), int(a[-1])) for a in torch_archs if a.startswith("sm_") and a[3:].isdigit()
    ]
    newest = max(supported, default=(99, 9))
    archs = sorted({min((c[0], c[1]), newest) for c in capabilities})
    if not archs:
        raise RuntimeError("no CUDA device is visible to build the CUDA kernels for")
    flags = [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in archs]
    last = "{}{}".format(*archs[-1])
    flags.append(f"-gencode=arch=compute_{last},code=compute_{last}")
    return ";".join(f"{a}.{b}" for a, b in archs) + "+PTX", flags


def _library(folder: Path, name: str) -> Path:
    built = sorted(folder.glob(f"{name}*.so"))
    if not built:
        raise ImportError(f"no {name}*.so in {folder}")
    return built[0]


def _import_from(folder: Path, name: str) -> ModuleType:
    library = _library(folder, name)
    if name in sys.modules:
        return sys.modules[name]
    problem = build_cache.record_problem(library)
    if problem is not None:  # never dlopen an unvouched library: cut short, it is a SIGBUS
        raise ImportError(problem)
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _refuse_blocked(folder: Path, what: str) -> None:
    if folder.exists() and not folder.is_dir():
        # no build could ever be renamed into place: every start would compile again (~45 s), silently
        raise RuntimeError(
            f"the {what} {folder} is taken by a file, so no build can be cached; "
            f"remove it (rm {folder}) or point {CACHE_ENV} at another folder"
        )


def _build_failed(exc: Exception, log: Path) -> RuntimeError:
    """One line for a failed compile (its first error lines), the whole output kept in ``log``."""
    output = str(exc)
    try:
        build_cache.write_atomic(log, output.encode("utf-8", "replace"))
        where = f"full compiler output in {log}"
    except OSError as err:
        where = f"the compiler output could not be kept in {log}: {err}"
    return RuntimeError(f"{build_cache.error_lines(output)} ({where})")


def jit_build(
    name: str,
    srcs: list[Path],
    *,
    cflags: list[str],
    cuda_cflags: list[str] | None = None,
    ldflags: list[str] | None = None,
    cache_root: Path | None = None,
    arch: str = "",
) -> ModuleType:
    """Build (once per cache folder) and import the extension ``name`` from ``srcs`` (``arch``: the GPU
    architectures a CUDA build compiles for, part of the folder's name).

    Safe for concurrent callers: an ``flock`` serializes the builders of one host, the staging folder plus
    ``os.rename`` makes the result appear whole (also across hosts sharing the cache), and the library is opened
    only where its build record vouches for it (``build_cache``). Raises on a failed build (its compiler output in
    ``<folder>.log`` beside the folder), a lock held too long, or a folder name taken by a file.
    """
    root = cache_root or default_cache_root()
    _refuse_blocked(root, "kernel cache folder")
    root.mkdir(parents=True, exist_ok=True)
    final = root / build_key(name, srcs, cflags + (cuda_cflags or []) + (ldflags or []), arch=arch)
    _refuse_blocked(final, "kernel build folder")
    if final.is_dir():
        with contextlib.suppress(ImportError):
            return _import_from(final, name)
    with build_cache.build_lock(root / f"{final.name}.lock"):
        _refuse_blocked(final, "kernel build folder")
        if final.is_dir():
            try:
                return _import_from(final, name)
            except ImportError as exc:  # a damaged build (a truncated .so): set it aside, rebuild
                logger.warning("fused kernels: rebuilding %s (%s)", final, exc)
                broken = root / f".broken-{final.name}.{socket.gethostname()}.{os.getpid()}"
                os.rename(final, broken)
                shutil.rmtree(broken, ignore_errors=True)
        return _build_into(
            final, name, srcs, cflags=cflags, cuda_cflags=cuda_cflags, ldflags=ldflags
        )


def _build_into(
    final: Path,
    name: str,
    srcs: list[Path],
    *,
    cflags: list[str],
    cuda_cflags: list[str] | None,
    ldflags: list[str] | None,
) -> ModuleType:
    from torch.utils import cpp_extension

    staging = final.parent / f".{final.name}.{socket.gethostname()}.{os.getpid()}"
    log = final.parent / f"{final.name}.log"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        compiled_in_this_process.append(name)
        try:
            module = cpp_extension.load(
                name,
                [str(s) for s in srcs],
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags,
                extra_ldflags=ldflags,
                build_directory=str(staging),
                verbose=False,
            )
        except Exception as exc:
            raise _build_failed(exc, log) from exc
        build_cache.write_record(_library(staging, name))
        with contextlib.suppress(FileNotFoundError):
            log.unlink()  # an earlier failure's output, stale now
        try:
            os.rename(staging, final)
        except OSError:  # another host's identical build won the rename
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return module


def prebuilt_flavour_file() -> Path:
    """Where ``setup.py`` records the CPU extension's instruction set (one of ``FLAVOURS``) next to it."""
    return Path(__file__).resolve().parent / "_cpu.flavour"


def prebuilt_sources_file(kind: str) -> Path:
    """Where ``setup.py`` records ``sources_digest`` of the sources it built the ``kind`` extension from."""
    return Path(__file__).resolve().parent / f"_{kind}.sources"


def _prebuilt_refused(kind: str) -> str | None:
    """Why the extension built at install must not even be imported here (None: import it).

    Checked before the import: importing AVX2 / AVX512 code on a CPU without them can kill the process (SIGILL).
    In a checkout (``csrc/`` present) the extension must also have been built from the sources there: one built
    before they were edited (and not rebuilt, or whose rebuild failed) is refused, and the JIT build compiles them."""
    if os.environ.get(PREBUILT_ENV) == "0":
        return f"{PREBUILT_ENV}=0"
    if importlib.util.find_spec(PREBUILT[kind]) is None:
        return None  # nothing was built at install: the import fails and the JIT build follows, as it should
    srcs = sources(kind)
    if srcs:
        record = prebuilt_sources_file(kind)
        recorded = record.read_text(encoding="utf-8").strip() if record.is_file() else ""
        if recorded != sources_digest(srcs):
            return (
                f"it was not built from the sources in {csrc_dir() / kind} ({record.name} "
                + ("records others" if recorded else "is missing")
                + "; they were edited after the install). Rebuild it: pip install --no-build-isolation -e ."
            )
    if kind != "cpu":
        return None
    flavour = prebuilt_flavour_file()
    recorded = flavour.read_text(encoding="utf-8").strip() if flavour.is_file() else "unknown"
    if host_runs(recorded):
        return None
    needs = " ".join(sorted(_FLAVOUR_CPU_FLAGS.get(recorded, {"?"})))
    return f"it may use {recorded} code ({flavour.name}) and this CPU lacks some of: {needs}"


def _jit(kind: str) -> ModuleType:
    from torch.utils import cpp_extension

    srcs = sources(kind)
    if not srcs:
        raise RuntimeError(f"no sources under {csrc_dir() / kind}")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count()
        arch, arch_flags = cuda_arch(
            os.environ.get(ARCH_ENV),
            [torch.cuda.get_device_capability(i) for i in range(count)],
            torch.cuda.get_arch_list(),
        )
        return jit_build(
            JIT_NAMES[kind], srcs, cflags=["-O3"], cuda_cflags=["-O3", *arch_flags], arch=arch
        )
    return jit_build(JIT_NAMES[kind], srcs, cflags=cpu_cflags(), ldflags=CPU_LDFLAGS)


def failure_line(exc: BaseException) -> str:
    """A failed JIT build as one line: the message (a compile failure is already one line naming its log), or
    the first error lines of a multi-line one."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return text if "\n" not in text else build_cache.error_lines(text)


def _find(kind: str) -> tuple[ModuleType | None, str]:
    if os.environ.get(NO_KERNELS_ENV) == "1":
        return None, f"PyTorch references ({NO_KERNELS_ENV}=1)"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None, "PyTorch references (no CUDA device)"
    refused = _prebuilt_refused(kind)
    if refused is None:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(PREBUILT[kind])
            return module, f"kernels built at install ({PREBUILT[kind]}, {module.build_info()})"
    elif not refused.startswith(PREBUILT_ENV):
        logger.warning("fused kernels (%s): not using %s: %s", kind, PREBUILT[kind], refused)
    try:
        module = _jit(kind)
    except Exception as exc:  # noqa: BLE001 - any build failure means the reference path
        why = failure_line(exc)
        log_rank_0(
            logger,
            "fused kernels (%s): no kernels (JIT build failed: %s); using the PyTorch references. Set "
            "%s=1 to skip the build.",
            kind,
            why,
            NO_KERNELS_ENV,
            level=logging.WARNING,
        )
        return None, f"PyTorch references (build failed: {why})"
    return module, f"kernels JIT-built into {default_cache_root()} ({module.build_info()})"


def extension(kind: str) -> ModuleType | None:
    """The compiled kernels for device type ``kind`` (``cpu`` / ``cuda``), or None: use the references.

    Looked up once per process and device type (the result is kept)."""
    if kind not in _modules:
        if kind not in PREBUILT:
            module, status = None, "PyTorch references (no kernels for this device type)"
        else:
            module, status = _find(kind)
            log_rank_0(logger, "fused kernels (%s): %s", kind, status)
        _modules[kind], _status[kind] = module, status
    return _modules[kind]


def force_references(kind: str, reason: str) -> None:
    """From now on this process runs the references on ``kind`` devices (e.g. because another rank must)."""
    _modules[kind] = None
    _status[kind] = f"PyTorch references ({reason})"


def status() -> dict[str, str]:
    """What each device type looked up so far uses (``{"cpu": "kernels built at install (...)"}``)."""
    return dict(_status)
