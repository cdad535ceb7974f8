"""Read a node's RDMA ports, network interfaces and GPU topology (sysfs, ``nvidia-smi``) and the launcher's files.

The sysfs files read, per RDMA device ``d`` and port ``n`` (``gids/<i>`` of an unused entry reads as zeros and its
``gid_attrs`` as an error)::

    /sys/class/infiniband/d/ports/n/{state, phys_state, link_layer, rate}   "4: ACTIVE", "5: LinkUp", "Ethernet"
    /sys/class/infiniband/d/ports/n/gids/i                                  "0000:...:ffff:0a00:0001"
    /sys/class/infiniband/d/ports/n/gid_attrs/{types,ndevs}/i               "RoCE v2", "eth2"
    /sys/class/net/if/{operstate, mtu, address}

A RoCE port (``link_layer`` Ethernet) lists each IP address of its interface twice, as a RoCE v1 and a RoCE v2 GID.
The rules over what is read: :mod:`megatron.diagnostics.cluster_check`.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROCE_V2 = "RoCE v2"


@dataclass
class Gid:
    """One non-empty GID table entry."""

    index: int
    gid: str
    type: str | None
    ndev: str | None
    ipv4: str | None
    """The IPv4 address when the GID is IPv4-mapped (``::ffff:a.b.c.d``)."""


@dataclass
class IbPort:
    """One port of an RDMA device."""

    device: str
    port: int
    state: str
    phys_state: str
    link_layer: str
    rate: str
    gids: list[Gid] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)
    roce_v2_gid_index: int | None = None
    """The GID index RoCE v2 over IPv4 needs (lowest such entry); None for InfiniBand or when there is none."""

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def is_roce(self) -> bool:
        return self.link_layer.lower() == "ethernet"

    @property
    def active(self) -> bool:
        return self.state.upper().endswith("ACTIVE")


@dataclass
class NetInterface:
    """One entry of ``/sys/class/net``."""

    name: str
    operstate: str
    mtu: int | None
    address: str


# --- reading ---------------------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):  # unused GID attributes read as EINVAL
        return None


def _numbered(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _gid(port_dir: Path, index: int) -> Gid | None:
    text = _read(port_dir / "gids" / str(index))
    try:
        addr = ipaddress.IPv6Address(text or "")
    except ValueError:
        return None
    if addr == ipaddress.IPv6Address(0):
        return None
    mapped = addr.ipv4_mapped
    return Gid(
        index=index,
        gid=f"::ffff:{mapped}" if mapped is not None else str(addr),
        type=_read(port_dir / "gid_attrs" / "types" / str(index)),
        ndev=_read(port_dir / "gid_attrs" / "ndevs" / str(index)),
        ipv4=str(mapped) if mapped is not None else None,
    )


def roce_v2_gid_index(gids: list[Gid]) -> int | None:
    """The lowest index of a RoCE v2 GID with an IPv4-mapped address (what NCCL_IB_GID_INDEX should be)."""
    found = [g.index for g in gids if g.type == ROCE_V2 and g.ipv4 is not None]
    return min(found) if found else None


def read_ib_ports(sysfs_root: Path) -> list[IbPort]:
    """Every port of every device under ``<sysfs_root>/class/infiniband`` (empty when there is none)."""
    base = sysfs_root / "class" / "infiniband"
    ports = []
    for dev in sorted(p for p in base.iterdir()) if base.is_dir() else []:
        pci_netdevs = sorted(p.name for p in (dev / "device" / "net").glob("*"))
        for n in _numbered(dev / "ports"):
            d = dev / "ports" / str(n)
            gids = [g for i in _numbered(d / "gids") if (g := _gid(d, i)) is not None]
            netdevs = sorted({g.ndev for g in gids if g.ndev} | set(pci_netdevs))
            port = IbPort(
                device=dev.name,
                port=n,
                state=_read(d / "state") or "?",
                phys_state=_read(d / "phys_state") or "?",
                link_layer=_read(d / "link_layer") or "InfiniBand",
                rate=_read(d / "rate") or "?",
                gids=gids,
                netdevs=netdevs,
            )
            if port.is_roce:
                port.roce_v2_gid_index = roce_v2_gid_index(gids)
            ports.append(port)
    return ports


def read_interfaces(sysfs_root: Path) -> list[NetInterface]:
    """Every interface under ``<sysfs_root>/class/net``."""
    base = sysfs_root / "class" / "net"
    out = []
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        mtu = _read(d / "mtu")
        out.append(
            NetInterface(
                name=d.name,
                operstate=_read(d / "operstate") or "?",
                mtu=int(mtu) if mtu and mtu.isdigit() else None,
                address=_read(d / "address") or "",
            )
        )
    return out


def gpu_nic_topology(nvidia_smi: str | None = "nvidia-smi") -> tuple[str | None, str]:
    """``(matrix, note)``: the output of ``nvidia-smi topo -m``, or None and why it was skipped."""
    exe = shutil.which(nvidia_smi) if nvidia_smi else None
    if exe is None:
        return None, "nvidia-smi not found: GPU-NIC topology skipped"
    try:
        done = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi topo -m failed ({e}): GPU-NIC topology skipped"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return None, f"nvidia-smi topo -m exited {done.returncode} ({why[0] if why else ''})"
    return done.stdout.rstrip(), "nvidia-smi topo -m"


def read_deepspeed_env(dirs: list[Path], name: str) -> tuple[dict[str, str], list[str]]:
    """``(variables, bad_lines)`` of the ``.deepspeed_env`` files the launcher reads (``~`` then ``.``)."""
    found: dict[str, str] = {}
    bad = []
    for d in dirs:
        path = d / name
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text().splitlines(keepends=True), 1):
            key, eq, value = line.partition("=")
            if not eq:
                bad.append(f"{path}:{lineno}")
                continue
            found[key] = value.strip()
    return found, bad


def hostfile_hosts(path: Path) -> list[str]:
    """The hosts of a DeepSpeed hostfile (``host slots=N`` lines; ``#`` comments)."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln.split()[0] for ln in lines if ln]
