"""tools/check_cluster.py on a fake sysfs tree: the GID index RoCE v2 needs, and each warning firing exactly when
its misconfiguration is there (and not otherwise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron.diagnostics import cluster_check as cc
from megatron.diagnostics import cluster_sysfs as cs
from tools import check_cluster

V1, V2 = "IB/RoCE v1", "RoCE v2"
LINK_LOCAL = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
MAPPED = "0000:0000:0000:0000:0000:ffff:0a00:0001"  # ::ffff:10.0.0.1
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def add_port(
    root: Path,
    dev: str,
    *,
    link_layer: str = "Ethernet",
    state: str = "4: ACTIVE",
    phys: str = "5: LinkUp",
    gids: list[tuple[str, str | None, str | None]] = (),
    netdev: str | None = None,
) -> None:
    """One device with port 1; ``gids[i] = (gid, type, ndev)`` (type None: an unused entry, attrs unreadable)."""
    port = root / "class" / "infiniband" / dev / "ports" / "1"
    for name, text in (
        ("state", state),
        ("phys_state", phys),
        ("link_layer", link_layer),
        ("rate", "100 Gb/sec (4X EDR)"),
    ):
        _write(port / name, text)
    for i, (gid, kind, ndev) in enumerate(gids):
        _write(port / "gids" / str(i), gid)
        if (
            kind is not None
        ):  # the kernel returns EINVAL for an unused entry's attributes: no file here
            _write(port / "gid_attrs" / "types" / str(i), kind)
        if ndev is not None:
            _write(port / "gid_attrs" / "ndevs" / str(i), ndev)
    if netdev:
        (root / "class" / "infiniband" / dev / "device" / "net" / netdev).mkdir(parents=True)


def add_netdev(root: Path, name: str, state: str = "up", mtu: int = 1500) -> None:
    for field, text in (("operstate", state), ("mtu", str(mtu)), ("address", "02:00:00:00:00:01")):
        _write(root / "class" / "net" / name / field, text)


def roce_gids(ndev: str, mapped: str = MAPPED) -> list[tuple[str, str | None, str | None]]:
    """The usual mlx5 table: link-local v1, v2, then the IPv4 address v1, v2, then an unused entry."""
    return [
        (LINK_LOCAL, V1, ndev),
        (LINK_LOCAL, V2, ndev),
        (mapped, V1, ndev),
        (mapped, V2, ndev),
        (ZERO, None, None),
    ]


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """mlx5_0: RoCE on eth2 (RoCE v2 IPv4 GID at index 3); mlx5_1: InfiniBand; mlx5_2: RoCE, port DOWN."""
    root = tmp_path / "sys"
    add_port(root, "mlx5_0", gids=roce_gids("eth2"), netdev="eth2")
    add_port(root, "mlx5_1", link_layer="InfiniBand", gids=[(LINK_LOCAL, V1, None)])
    add_port(
        root,
        "mlx5_2",
        state="1: DOWN",
        phys="3: Disabled",
        gids=[(ZERO, None, None)],
        netdev="eth3",
    )
    add_netdev(root, "eth0")
    add_netdev(root, "eth2", mtu=9000)
    add_netdev(root, "eth3", state="down", mtu=9000)
    add_netdev(root, "lo", state="unknown", mtu=65536)
    return root


GOOD = {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_HCA": "=mlx5_0,mlx5_1"}
"""The settings under which the fixture's node is correct (mlx5_2 is down, so it is left out)."""


def warnings(root: Path, env: dict[str, str], **kw: object) -> list[cc.Finding]:
    inputs = cc.Inputs(sysfs_root=root, environ=env, nvidia_smi=None, **kw)
    return cc.check_cluster(inputs).warnings


def variables(root: Path, env: dict[str, str], **kw: object) -> list[str]:
    return [w.variable for w in warnings(root, env, **kw)]


def test_sysfs_is_read_and_the_roce_v2_gid_index_is_found(sysfs: Path) -> None:
    ports = {p.name: p for p in cs.read_ib_ports(sysfs)}
    assert list(ports) == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1"]
    roce, ib, down = ports["mlx5_0:1"], ports["mlx5_1:1"], ports["mlx5_2:1"]
    assert roce.is_roce and roce.active and roce.netdevs == ["eth2"]
    assert [(g.index, g.type, g.ipv4) for g in roce.gids] == [
        (0, V1, None),
        (1, V2, None),
        (2, V1, "10.0.0.1"),
        (3, V2, "10.0.0.1"),
    ]  # index 4 is all zeros: not an entry
    assert roce.roce_v2_gid_index == 3 and roce.gids[3].gid == "::ffff:10.0.0.1"
    assert not ib.is_roce and ib.roce_v2_gid_index is None and ib.gids[0].ndev is None
    assert not down.active and down.gids == [] and down.roce_v2_gid_index is None
    # The lowest RoCE v2 IPv4 entry wins; v2 IPv6 and v1 IPv4 entries never do.
    gids = [cs.Gid(5, "::ffff:10.0.0.2", V2, "eth2", "10.0.0.2"), *roce.gids]
    assert cs.roce_v2_gid_index(gids) == 3
    assert cs.roce_v2_gid_index(roce.gids[:3]) is None
    nets = {i.name: (i.operstate, i.mtu) for i in cs.read_interfaces(sysfs)}
    assert nets == {
        "eth0": ("up", 1500),
        "eth2": ("up", 9000),
        "eth3": ("down", 9000),
        "lo": ("unknown", 65536),
    }


def test_a_correct_node_has_no_warning_and_suggests_the_gid_index(sysfs: Path) -> None:
    report = cc.check_cluster(cc.Inputs(sysfs_root=sysfs, environ=GOOD, nvidia_smi=None))
    assert report.warnings == []
    assert report.suggested == {"NCCL_IB_GID_INDEX": "3"}
    assert cc.check_cluster(cc.Inputs(sysfs_root=sysfs / "nothing", environ={})).ib_ports == []


def test_gid_index_warnings(sysfs: Path) -> None:
    hca = {"NCCL_IB_HCA": GOOD["NCCL_IB_HCA"]}
    for unset in ({}, {"NCCL_IB_GID_INDEX": "-1"}):
        found = warnings(sysfs, {**hca, **unset})
        assert [w.variable for w in found] == ["NCCL_IB_GID_INDEX"]
        assert (
            "then uses GID 0, which is IB/RoCE v1 fe80::202:c9ff:fe00:1 on mlx5_0:1"
            in found[0].message
        )
        assert found[0].message.endswith("set NCCL_IB_GID_INDEX=3")
    for wrong, what in (("0", V1), ("2", V1), ("7", "empty")):
        found = warnings(sysfs, {**hca, "NCCL_IB_GID_INDEX": wrong})
        assert [w.variable for w in found] == ["NCCL_IB_GID_INDEX"], wrong
        assert what in found[0].message and "mlx5_0:1" in found[0].message
    assert variables(sysfs, {**hca, "NCCL_IB_GID_INDEX": "x"}) == ["NCCL_IB_GID_INDEX"]
    assert variables(sysfs, {**hca, "NCCL_IB_GID_INDEX": "1"}) == []  # RoCE v2 (IPv6): allowed
    # Unset is fine where GID 0 already is the RoCE v2 IPv4 entry.
    add_port(sysfs, "mlx5_5", gids=[(MAPPED, V2, "eth6")])
    assert variables(sysfs, {"NCCL_IB_HCA": "=mlx5_5"}) == []
    # Only RoCE ports count: with the RoCE device left out, no GID warning at all.
    assert variables(sysfs, {"NCCL_IB_HCA": "=mlx5_1"}) == []
    assert variables(sysfs, {"NCCL_IB_HCA": "=mlx5_1", "NCCL_IB_GID_INDEX": "0"}) == []


def test_gid_index_differs_between_ports_and_a_port_without_ipv4(sysfs: Path) -> None:
    shifted = [(LINK_LOCAL, V1, "eth4"), (LINK_LOCAL, V2, "eth4"), (MAPPED, V2, "eth4")]
    add_port(sysfs, "mlx5_3", gids=shifted, netdev="eth4")
    add_netdev(sysfs, "eth4", mtu=9000)
    env = {"NCCL_IB_HCA": "=mlx5_0,mlx5_3", "NCCL_IB_GID_INDEX": "3"}
    found = warnings(sysfs, env)
    assert [w.variable for w in found] == ["NCCL_IB_GID_INDEX", "NCCL_IB_GID_INDEX"]
    assert "mlx5_0:1: 3, mlx5_3:1: 2" in found[0].message
    assert "NCCL_IB_GID_INDEX=3 is empty on mlx5_3:1" in found[1].message
    add_port(sysfs, "mlx5_4", gids=[(LINK_LOCAL, V1, "eth5"), (LINK_LOCAL, V2, "eth5")])
    found = warnings(sysfs, {"NCCL_IB_HCA": "=mlx5_4", "NCCL_IB_GID_INDEX": "1"})
    assert [w.variable for w in found] == ["NCCL_IB_GID_INDEX"]
    assert "no RoCE v2 GID with an IPv4 address" in found[0].message


def test_hca_list_and_port_state(sysfs: Path) -> None:
    gid = {"NCCL_IB_GID_INDEX": "3"}
    # No NCCL_IB_HCA: NCCL would try every port, the DOWN one included.
    found = warnings(sysfs, gid)
    assert [w.variable for w in found] == ["NCCL_IB_HCA"] and "mlx5_2:1 is 1: DOWN" in found[
        0
    ].message
    assert variables(sysfs, {**gid, "NCCL_IB_HCA": "^mlx5_2"}) == []
    assert variables(sysfs, {**gid, "NCCL_IB_HCA": "mlx5_0:1,mlx5_1"}) == []
    # A prefix selects every mlx5 device, the DOWN one too.
    assert variables(sysfs, {**gid, "NCCL_IB_HCA": "mlx5"}) == ["NCCL_IB_HCA"]
    found = warnings(sysfs, {**gid, "NCCL_IB_HCA": "=mlx5_0,mlx5_9"})
    assert [w.variable for w in found] == ["NCCL_IB_HCA"] and "'mlx5_9' names no RDMA" in found[
        0
    ].message
    found = warnings(sysfs, {**gid, "NCCL_IB_HCA": "=mlx5_0:2"})
    assert [w.variable for w in found] == ["NCCL_IB_HCA"] and "no port 2" in found[0].message
    # "=" makes names exact: "mlx5" then names nothing.
    assert variables(sysfs, {**gid, "NCCL_IB_HCA": "=mlx5"}) == ["NCCL_IB_HCA"]


def test_ib_disable_while_devices_exist(sysfs: Path) -> None:
    found = warnings(sysfs, {"NCCL_IB_DISABLE": "1"})
    assert [w.variable for w in found] == ["NCCL_IB_DISABLE"]  # and no port or GID warnings
    assert variables(sysfs, {**GOOD, "NCCL_IB_DISABLE": "0"}) == []
    assert variables(sysfs / "none", {"NCCL_IB_DISABLE": "1"}) == []  # no RDMA device: nothing lost


def test_socket_interfaces(sysfs: Path) -> None:
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert variables(sysfs, {**GOOD, var: "eth0"}) == []
        found = warnings(sysfs, {**GOOD, var: "eth9"})
        assert [w.variable for w in found] == [var] and "no interface 'eth9'" in found[0].message
        assert found[0].message.endswith(f"set {var}=eth0")
        found = warnings(sysfs, {**GOOD, var: "eth3"})
        assert [w.variable for w in found] == [var] and "eth3 is down" in found[0].message
    # NCCL's list syntax: prefixes, "^" excludes, "=" exact; Gloo's names are exact.
    assert variables(sysfs, {**GOOD, "NCCL_SOCKET_IFNAME": "eth"}) == []
    assert variables(sysfs, {**GOOD, "NCCL_SOCKET_IFNAME": "^eth3,docker"}) == []
    assert variables(sysfs, {**GOOD, "NCCL_SOCKET_IFNAME": "=eth"}) == ["NCCL_SOCKET_IFNAME"]
    assert variables(sysfs, {**GOOD, "GLOO_SOCKET_IFNAME": "eth"}) == ["GLOO_SOCKET_IFNAME"]


def test_mtu_mismatch_between_roce_interfaces(sysfs: Path) -> None:
    add_port(sysfs, "mlx5_3", gids=roce_gids("eth4"), netdev="eth4")
    add_netdev(sysfs, "eth4", mtu=1500)
    env = {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_HCA": "=mlx5_0,mlx5_3"}
    found = warnings(sysfs, env)
    assert [w.variable for w in found] == ["MTU"] and "eth2 9000, eth4 1500" in found[0].message
    (sysfs / "class" / "net" / "eth4" / "mtu").write_text("9000\n")
    assert variables(sysfs, env) == []
    # The DOWN port's eth3 and the non-RoCE eth0 never count.
    assert variables(sysfs, {"NCCL_IB_GID_INDEX": "3", "NCCL_IB_HCA": "=mlx5_0"}) == []


def test_multi_node_forwarding_through_deepspeed_env(sysfs: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=8\nnode2 slots=8\n")
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {
        **GOOD,
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_DEBUG": "INFO",  # forwarded by the launcher (NCCL*)
        "MASTER_ADDR": "node1",  # set by the launcher on every node
    }
    kw = {"hostfile": hostfile, "deepspeed_env_dirs": (home, cwd)}
    found = warnings(sysfs, env, **kw)
    assert [w.variable for w in found] == [
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "GLOO_SOCKET_IFNAME",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ]
    assert "add the line GLOO_SOCKET_IFNAME=eth0 to ./.deepspeed_env" in found[1].message
    (home / ".deepspeed_env").write_text("CUDA_DEVICE_MAX_CONNECTIONS=1\n")
    (cwd / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n\n")
    found = warnings(sysfs, env, **kw)
    assert [w.variable for w in found] == [".deepspeed_env", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert f"{cwd / '.deepspeed_env'}:2" in found[0].message  # the blank line the launcher fails on
    (cwd / ".deepspeed_env").write_text(
        "GLOO_SOCKET_IFNAME=eth0\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n"
    )
    assert variables(sysfs, env, **kw) == []
    hostfile.write_text("node1 slots=8\n")  # one node: nothing to forward
    (cwd / ".deepspeed_env").unlink()
    assert variables(sysfs, env, **kw) == []


def test_forwarded_prefixes_match_the_installed_deepspeed() -> None:
    from deepspeed.launcher.runner import EXPORT_ENVS

    assert set(cc.DEEPSPEED_FORWARDED) == {*EXPORT_ENVS, "NCCL"}


def test_topology_from_nvidia_smi_or_skipped(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\n[ "$1 $2" = "topo -m" ] && echo "GPU0 X PIX NIC0" && exit 0\nexit 3\n'
    )
    fake.chmod(0o755)
    assert cs.gpu_nic_topology(str(fake)) == ("GPU0 X PIX NIC0", "nvidia-smi topo -m")
    text, note = cs.gpu_nic_topology(str(tmp_path / "missing"))
    assert text is None and "skipped" in note
    assert cs.gpu_nic_topology(None)[0] is None


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in list(os.environ):
        if k.startswith(cc.ENV_PREFIXES) or k in cc.ENV_NAMES:
            monkeypatch.delenv(k)
    return monkeypatch


def test_cli_text_json_and_exit_codes(
    sysfs: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--sysfs-root", str(sysfs), "--no-topology"]
    clean_env.setattr(check_cluster, "DEEPSPEED_DEFAULT_HOSTFILE", sysfs / "no-hostfile")
    for k, v in GOOD.items():
        clean_env.setenv(k, v)
    assert check_cluster.main([*args, "--strict"]) == 0
    text = capsys.readouterr().out
    assert "mlx5_0:1  RoCE  state 4: ACTIVE" in text and "RoCE v2 IPv4 GID index: 3" in text
    assert "export NCCL_IB_GID_INDEX=3" in text and "== Warnings (0)" in text
    clean_env.setenv("NCCL_IB_GID_INDEX", "0")
    clean_env.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert check_cluster.main([*args, "--json"]) == 0  # warnings alone do not fail
    doc = json.loads(capsys.readouterr().out)
    assert doc["env"] == {**GOOD, "NCCL_IB_GID_INDEX": "0", "GLOO_SOCKET_IFNAME": "eth9"}
    assert [w["variable"] for w in doc["warnings"]] == ["NCCL_IB_GID_INDEX", "GLOO_SOCKET_IFNAME"]
    assert [p["roce_v2_gid_index"] for p in doc["ib_ports"]] == [3, None, None]
    assert {i["name"] for i in doc["interfaces"]} == {"eth0", "eth2", "eth3", "lo"}
    assert check_cluster.main([*args, "--strict"]) == 1
    capsys.readouterr()
    for bad, message in (
        (["--sysfs-root", str(sysfs / "no")], "error: --sysfs-root"),
        (["--hostfile", str(sysfs / "no")], "error: --hostfile"),
        (["--jsn"], "error: unrecognized arguments: --jsn (run with --help"),
    ):
        assert check_cluster.main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err
