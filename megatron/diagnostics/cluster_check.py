"""Pre-flight view of a node's network for NCCL / Gloo over RoCE or InfiniBand, and its common misconfigurations.

Reads the environment and sysfs only (:mod:`megatron.diagnostics.cluster_sysfs`, plus ``nvidia-smi topo -m`` where it
exists); no process group. A RoCE port lists each IP address of its interface as a RoCE v1 and a RoCE v2 GID; NCCL
routes over IP (RoCE v2) only with the index of the v2 GID whose address is IPv4-mapped (``::ffff:a.b.c.d``) in
``NCCL_IB_GID_INDEX``. NCCL before 2.21 defaults to index 0, the RoCE v1 link-local GID: the classic "hangs or is
10x slower" RoCE setup. NCCL 2.21+ picks a GID itself when the variable is unset (or -1).

``NCCL_IB_HCA`` and ``NCCL_SOCKET_IFNAME`` are NCCL's lists: comma-separated prefixes (``mlx5`` matches
``mlx5_0``), ``=`` first for exact names, ``^`` first to exclude, ``:port`` after an HCA. ``GLOO_SOCKET_IFNAME``
holds exact interface names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron.diagnostics.cluster_sysfs import (
    ROCE_V2,
    Gid,
    IbPort,
    NetInterface,
    gpu_nic_topology,
    hostfile_hosts,
    read_deepspeed_env,
    read_ib_ports,
    read_interfaces,
)

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_")
ENV_NAMES = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "DS_ENV_FILE",
)
LAUNCHER_SET = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES",
)
"""Set per node by the launcher itself: never need forwarding."""
LOCAL_ONLY = ("DS_ENV_FILE",)
"""Read by the launcher on the launching node only."""
DEEPSPEED_FORWARDED = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX")
"""Prefixes the deepspeed 0.19.8 multi-node launcher exports to other nodes (``runner.EXPORT_ENVS`` + the CUDA
accelerator's ``NCCL``); anything else reaches them only through a ``.deepspeed_env`` file."""
_OK_OPERSTATES = ("up", "unknown")  # "unknown": lo and some virtual links, which carry traffic


@dataclass
class Finding:
    """A warning: the variable (or setting) to change and the sentence saying how."""

    variable: str
    message: str


@dataclass
class ClusterReport:
    """Everything :func:`check_cluster` found; :meth:`to_dict` is the ``--json`` document."""

    env: dict[str, str]
    ib_ports: list[IbPort]
    interfaces: list[NetInterface]
    topology: str | None
    topology_note: str
    suggested: dict[str, str]
    warnings: list[Finding]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)


def read_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The set variables that matter to NCCL, Gloo and the launchers."""
    return {k: environ[k] for k in sorted(environ) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


# --- NCCL's list syntax --------------------------------------------------------------------------------------


def _nccl_list(spec: str) -> tuple[bool, bool, list[str]]:
    """``(exclude, exact, entries)`` of an NCCL_IB_HCA / NCCL_SOCKET_IFNAME value."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    return exclude, exact, [e.strip() for e in spec.split(",") if e.strip()]


def _name_matches(entry: str, name: str, exact: bool) -> bool:
    return name == entry if exact else name.startswith(entry)


def hca_selects(spec: str | None, port: IbPort) -> bool:
    """Whether NCCL uses ``port`` under ``NCCL_IB_HCA=spec`` (None or empty: every port)."""
    if not spec:
        return True
    exclude, exact, entries = _nccl_list(spec)
    hit = False
    for e in entries:
        dev, _, num = e.partition(":")
        hit = hit or (_name_matches(dev, port.device, exact) and (not num or num == str(port.port)))
    return hit != exclude


# --- warnings ------------------------------------------------------------------------------------------------


def _hca_findings(spec: str, ports: list[IbPort]) -> list[Finding]:
    _, exact, entries = _nccl_list(spec)
    devices = sorted({p.device for p in ports})
    active = sorted({p.device for p in ports if p.active})
    out = []
    for e in entries:
        dev, _, num = e.partition(":")
        matching = [p for p in ports if _name_matches(dev, p.device, exact)]
        if not matching:
            have = ", ".join(devices) or "none"
            out.append(
                Finding(
                    "NCCL_IB_HCA",
                    f"NCCL_IB_HCA={spec}: {e!r} names no RDMA device here (devices: {have}); set "
                    f"NCCL_IB_HCA to active devices, e.g. NCCL_IB_HCA={','.join(active) or '<unset>'}",
                )
            )
        elif num and not any(str(p.port) == num for p in matching):
            out.append(
                Finding(
                    "NCCL_IB_HCA",
                    f"NCCL_IB_HCA={spec}: {dev} has no port {num} (ports: "
                    f"{', '.join(p.name for p in matching)}); fix the :port suffix",
                )
            )
    return out


def _port_findings(ports: list[IbPort]) -> list[Finding]:
    """A port NCCL would use that is not ACTIVE; an active RoCE port without a RoCE v2 IPv4 GID."""
    out = []
    for p in ports:
        if not p.active:
            out.append(
                Finding(
                    "NCCL_IB_HCA",
                    f"{p.name} is {p.state} (phys_state {p.phys_state}): NCCL cannot use it; bring the "
                    f"link up, or leave it out with NCCL_IB_HCA=^{p.name}",
                )
            )
        elif p.is_roce and p.roce_v2_gid_index is None:
            out.append(
                Finding(
                    "NCCL_IB_GID_INDEX",
                    f"{p.name} (RoCE, {', '.join(p.netdevs) or 'no netdev'}) has no RoCE v2 GID with an "
                    "IPv4 address: give its interface an IPv4 address, then set NCCL_IB_GID_INDEX to the "
                    "index this check reports",
                )
            )
    return out


def _gid_at(port: IbPort, index: int) -> Gid | None:
    return next((g for g in port.gids if g.index == index), None)


def _describe(g: Gid | None) -> str:
    return "empty" if g is None else f"{g.type or 'unknown type'} {g.gid}"


def _gid_fix(wanted: dict[str, int]) -> str:
    """The advice for NCCL_IB_GID_INDEX given the RoCE v2 IPv4 index of each port that has one."""
    if not wanted:
        return "NCCL_IB_GID_INDEX once the RoCE interfaces have IPv4 addresses"
    if len(set(wanted.values())) == 1:
        return f"NCCL_IB_GID_INDEX={next(iter(wanted.values()))}"
    return "NCCL_IB_GID_INDEX to " + ", ".join(f"{i} for {n}" for n, i in wanted.items())


def _gid_index_findings(roce: list[IbPort], value: str | None) -> list[Finding]:
    """NCCL_IB_GID_INDEX (``value``) against the active RoCE ports NCCL would use."""
    wanted = {p.name: p.roce_v2_gid_index for p in roce if p.roce_v2_gid_index is not None}
    fix = _gid_fix(wanted)
    out = []
    if len(set(wanted.values())) > 1:
        out.append(
            Finding(
                "NCCL_IB_GID_INDEX",
                "the RoCE v2 IPv4 GID has different indexes on different ports ("
                + ", ".join(f"{n}: {i}" for n, i in wanted.items())
                + "); one NCCL_IB_GID_INDEX cannot fit all: leave it unset with NCCL >= 2.21 "
                "(NCCL_IB_ROCE_VERSION_NUM=2, NCCL_IB_ADDR_FAMILY=AF_INET) or list one HCA per job",
            )
        )
    if value is None or value in ("", "-1"):  # -1: NCCL 2.21+'s "pick one"; older NCCL then uses 0
        bad = [p for p in roce if (g := _gid_at(p, 0)) is None or g.type != ROCE_V2]
        if bad and wanted:
            shown = "-1" if value == "-1" else "not set"
            out.append(
                Finding(
                    "NCCL_IB_GID_INDEX",
                    f"NCCL_IB_GID_INDEX is {shown}: NCCL before 2.21 then uses GID 0, which is "
                    + ", ".join(f"{_describe(_gid_at(p, 0))} on {p.name}" for p in bad)
                    + f", not RoCE v2; set {fix}",
                )
            )
        return out
    if not value.isdigit():
        msg = f"NCCL_IB_GID_INDEX={value!r} is not a GID index; set {fix}"
        return [*out, Finding("NCCL_IB_GID_INDEX", msg)]
    for p in roce:
        g = _gid_at(p, int(value))
        if g is None or g.type != ROCE_V2:
            out.append(
                Finding(
                    "NCCL_IB_GID_INDEX",
                    f"NCCL_IB_GID_INDEX={value} is {_describe(g)} on {p.name}, not a RoCE v2 GID; "
                    f"set {fix}",
                )
            )
    return out


def _mtu_findings(roce: list[IbPort], interfaces: list[NetInterface]) -> list[Finding]:
    by_name = {i.name: i for i in interfaces}
    mtus = {n: by_name[n].mtu for p in roce for n in p.netdevs if n in by_name}
    if len(set(mtus.values())) <= 1:
        return []
    top = max(m or 0 for m in mtus.values())
    return [
        Finding(
            "MTU",
            "MTU differs between RoCE interfaces ("
            + ", ".join(f"{n} {m}" for n, m in sorted(mtus.items()))
            + f"): RoCE uses the smallest path MTU; set one MTU everywhere (e.g. ip link set dev IF mtu "
            f"{top}) and on the switch ports",
        )
    ]


def _socket_findings(
    variable: str, spec: str, interfaces: list[NetInterface], nccl_syntax: bool
) -> list[Finding]:
    exclude, exact, entries = _nccl_list(spec) if nccl_syntax else (False, True, spec.split(","))
    if exclude:
        return []  # excluding an interface that does not exist changes nothing
    up = [i.name for i in interfaces if i.operstate in _OK_OPERSTATES and i.name != "lo"]
    hint = f"set {variable}={up[0]}" if up else f"set {variable} to an interface that is up"
    out = []
    for e in (e.strip() for e in entries if e.strip()):
        matching = [i for i in interfaces if _name_matches(e, i.name, exact)]
        if not matching:
            names = ", ".join(i.name for i in interfaces) or "none"
            out.append(
                Finding(
                    variable,
                    f"{variable}={spec}: no interface {e!r} here (interfaces: {names}); {hint}",
                )
            )
        elif all(i.operstate not in _OK_OPERSTATES for i in matching):
            states = ", ".join(f"{i.name} is {i.operstate}" for i in matching)
            out.append(Finding(variable, f"{variable}={spec}: {states}; {hint}"))
    return out


def _forwarding_findings(
    env: dict[str, str],
    hosts: list[str],
    env_files: dict[str, str],
    bad_lines: list[str],
    file_name: str,
) -> list[Finding]:
    out = [
        Finding(
            file_name,
            f"{where}: a line without '=' makes the deepspeed launcher fail; remove it (blank lines too)",
        )
        for where in bad_lines
    ]
    for var, value in env.items():
        skip = var in LAUNCHER_SET or var in LOCAL_ONLY or var in env_files
        if skip or var.startswith(DEEPSPEED_FORWARDED):
            continue
        out.append(
            Finding(
                var,
                f"{var}={value} is set here but a {len(hosts)}-node hostfile launch does not forward it: the "
                f"deepspeed launcher sends only {'*, '.join(DEEPSPEED_FORWARDED)}* and the lines of "
                f"~/{file_name} or ./{file_name}; add the line {var}={value} to ./{file_name}",
            )
        )
    return out


@dataclass(frozen=True)
class Inputs:
    """Where :func:`check_cluster` looks (the tool's flags; tests point them at a fake tree)."""

    sysfs_root: Path = Path("/sys")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    hostfile: Path | None = None
    """A DeepSpeed hostfile; with more than one host the ``.deepspeed_env`` forwarding is checked."""
    deepspeed_env_dirs: tuple[Path, ...] = field(default_factory=lambda: (Path.home(), Path(".")))
    nvidia_smi: str | None = "nvidia-smi"


def find_warnings(
    env: dict[str, str],
    ports: list[IbPort],
    interfaces: list[NetInterface],
    inputs: Inputs,
) -> list[Finding]:
    """Every misconfiguration, each naming the variable to set (see the module docstring for the rules)."""
    out: list[Finding] = []
    ib_disabled = env.get("NCCL_IB_DISABLE", "0") == "1"
    if ib_disabled and ports:
        out.append(
            Finding(
                "NCCL_IB_DISABLE",
                f"NCCL_IB_DISABLE=1 while {len(ports)} RDMA port(s) exist ("
                + ", ".join(p.name for p in ports)
                + "): NCCL will use TCP sockets; unset NCCL_IB_DISABLE",
            )
        )
    if env.get("NCCL_IB_HCA"):
        out += _hca_findings(env["NCCL_IB_HCA"], ports)
    if not ib_disabled:
        used = [p for p in ports if hca_selects(env.get("NCCL_IB_HCA"), p)]
        roce = [p for p in used if p.is_roce and p.active]
        out += _port_findings(used)
        out += _gid_index_findings(roce, env.get("NCCL_IB_GID_INDEX"))
        out += _mtu_findings(roce, interfaces)
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if env.get(var):
            out += _socket_findings(var, env[var], interfaces, var.startswith("NCCL"))
    if inputs.hostfile is not None and inputs.hostfile.is_file():
        hosts = hostfile_hosts(inputs.hostfile)
        if len(hosts) > 1:
            name = env.get("DS_ENV_FILE", ".deepspeed_env")
            files, bad = read_deepspeed_env(list(inputs.deepspeed_env_dirs), name)
            out += _forwarding_findings(env, hosts, files, bad, name)
    return out


def suggested_settings(ports: list[IbPort], env: dict[str, str]) -> dict[str, str]:
    """Values to export, from what sysfs shows (the RoCE v2 GID index when every used RoCE port agrees)."""
    if env.get("NCCL_IB_DISABLE", "0") == "1":
        return {}
    used = [p for p in ports if hca_selects(env.get("NCCL_IB_HCA"), p) and p.is_roce and p.active]
    indexes = {p.roce_v2_gid_index for p in used}
    if len(indexes) == 1 and None not in indexes:
        return {"NCCL_IB_GID_INDEX": str(indexes.pop())}
    return {}


def check_cluster(inputs: Inputs | None = None) -> ClusterReport:
    """Read the environment, sysfs and the GPU topology; list what is there and what is wrong."""
    inputs = inputs or Inputs()
    env = read_env(inputs.environ)
    ports = read_ib_ports(inputs.sysfs_root)
    interfaces = read_interfaces(inputs.sysfs_root)
    topology, note = gpu_nic_topology(inputs.nvidia_smi)
    return ClusterReport(
        env=env,
        ib_ports=ports,
        interfaces=interfaces,
        topology=topology,
        topology_note=note,
        suggested=suggested_settings(ports, env),
        warnings=find_warnings(env, ports, interfaces, inputs),
    )


def _forwarding_note(var: str) -> str:
    if var in LAUNCHER_SET:
        return "set by the launcher"
    if var in LOCAL_ONLY:
        return "read on the launching node"
    if var.startswith(DEEPSPEED_FORWARDED):
        return "forwarded by deepspeed"
    return "deepspeed forwards it only through .deepspeed_env"


def format_report(report: ClusterReport) -> str:
    """The human-readable report: environment, RDMA ports with their GID tables, interfaces, topology, warnings."""
    lines = ["== NCCL / Gloo / launcher environment"]
    width = max((len(f"{k}={v}") for k, v in report.env.items()), default=0)
    lines += [f"  {f'{k}={v}':<{width}}  ({_forwarding_note(k)})" for k, v in report.env.items()]
    lines += [] if report.env else ["  (none set)"]
    lines.append("== InfiniBand / RoCE ports (/sys/class/infiniband)")
    for p in report.ib_ports:
        kind = "RoCE" if p.is_roce else "InfiniBand"
        v2 = "" if not p.is_roce else f"  RoCE v2 IPv4 GID index: {p.roce_v2_gid_index}"
        lines.append(
            f"  {p.name}  {kind}  state {p.state}  phys {p.phys_state}  rate {p.rate}  "
            f"netdev {','.join(p.netdevs) or '-'}{v2}"
        )
        lines += [
            f"    gid {g.index:<3} {g.gid:<28} {g.type or '-':<12} {g.ndev or '-'}" for g in p.gids
        ]
    lines += [] if report.ib_ports else ["  (no RDMA devices: NCCL will use TCP sockets)"]
    lines.append("== Network interfaces (/sys/class/net)")
    lines += [
        f"  {i.name:<12} {i.operstate:<8} mtu {i.mtu or '?':<6} {i.address}"
        for i in report.interfaces
    ]
    lines.append(f"== GPU-NIC topology ({report.topology_note})")
    lines += [f"  {ln}" for ln in (report.topology or "").splitlines()]
    if report.suggested:
        lines.append("== Suggested")
        lines += [f"  export {k}={v}" for k, v in report.suggested.items()]
    lines.append(f"== Warnings ({len(report.warnings)})")
    lines += [f"  [{w.variable}] {w.message}" for w in report.warnings] or ["  none"]
    return "\n".join(lines)
