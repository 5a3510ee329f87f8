"""``DeviceList``: a ``NET_DEVICES`` value read as UCX 1.22 reads it, row
by row and against the loaded UCX itself (a context restricted to tcp
starts only where the value leaves tcp a device). ``rdma-kv info`` and the
selftest's NIC checks both read NET_DEVICES through it."""

from __future__ import annotations

import pytest

from rdma_kv.errors import UCXError
from rdma_kv.transport.ucxinfo import DeviceList, loaded_ucx, parse_ucx_info, run_ucx_info, ucx_info_binary

HOST = ["lo", "eth0", "mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1"]


@pytest.mark.parametrize("value, allowed", [
    ("all", HOST),
    ("^all", HOST),                                    # UCX: all first means every device, ^ or not
    ("lo,all", ["lo"]),                                # a later all is only a name
    ("mlx5_0", ["mlx5_0:1", "mlx5_0:2"]),              # a base name is each of its ports
    ("mlx5_0:2", ["mlx5_0:2"]),
    ("mlx5_1", ["mlx5_1:1"]),                          # not mlx5_10:1: the base name is up to the colon
    ("mlx5", []),
    ("^mlx5_0,lo", ["eth0", "mlx5_1:1", "mlx5_10:1"]),
    ("mlx5_[0-1]:1", ["mlx5_0:1", "mlx5_1:1"]),        # a range spans each number
    ("mlx5_[0-10]", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1"]),
    ("mlx5_[1-0]:1", []),                              # first > last: the token is a plain name
    ("^mlx5_[0-1]:1", ["lo", "eth0", "mlx5_0:2", "mlx5_10:1"]),
    (",lo,,", ["lo"]),                                 # empty names are dropped
    (" lo", []),                                       # no spaces stripped
    ("", []),
])
def test_the_devices_a_value_allows(value: str, allowed: list[str]) -> None:
    assert [d for d in HOST if DeviceList.parse(value).allows(d)] == allowed


@pytest.mark.parametrize("value, unmatched", [
    ("lo,mlx5_9:1", ["mlx5_9:1"]),
    ("^mlx5_9:1", ["mlx5_9:1"]),                        # an exclusion that excludes nothing
    ("mlx5_[0-3]:1", []),                               # a range that spans one device is not misspelt
    ("mlx5_[2-3]:1", ["mlx5_[2-3]:1"]),                 # one that spans none is, as written
    ("mlx5_0, lo", [" lo"]),
    ("all", []),
])
def test_names_that_match_no_device_are_given_as_written(value: str, unmatched: list[str]) -> None:
    assert DeviceList.parse(value).unmatched(HOST) == unmatched


def test_all_among_other_names_is_refused_as_ucx_refuses_it() -> None:
    with pytest.raises(ValueError, match="'all' must stand alone"):
        DeviceList.parse("all,lo")


@pytest.mark.ucx
def test_the_loaded_ucx_agrees() -> None:
    """For each value: a context restricted to tcp starts exactly where
    ``DeviceList`` leaves tcp a device that ``ucx_info`` lists, and UCX
    refuses what ``parse`` refuses."""
    from rdma_kv.errors import ConfigError
    from rdma_kv.transport import ucx

    library = loaded_ucx().library
    binary = ucx_info_binary(library)
    if binary is None:
        pytest.skip("no ucx_info beside the loaded UCX")
    transports, _ = parse_ucx_info(run_ucx_info(binary, library))
    tcp = sorted({t["device"] for t in transports if t["transport"] == "tcp"})
    assert "lo" in tcp, tcp
    others = [d for d in tcp if d != "lo"]
    values = ["lo", "^lo", "^all", "lo,all", ",lo,,", " lo", "^ lo", "nothing", "^nothing", "l[0-3]", "all,lo"]
    values += [f"{d}" for d in others[:1]] + [f"^{','.join(tcp)}"]
    for value in values:
        try:
            expected = any(DeviceList.parse(value).allows(d) for d in tcp)
        except ValueError:
            expected = None  # refused
        try:
            ucx.Context({"TLS": "tcp", "NET_DEVICES": value}).close()
            started = True
        except ConfigError:
            started = None
        except UCXError:
            started = False
        assert started == expected, (value, tcp)
