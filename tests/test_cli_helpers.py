import pytest

from nvmeof.cli.commands.common import format_size, parse_size, table
from nvmeof.uri import TransportAddress, parse_address


@pytest.mark.parametrize(("text", "expected"), [
    ("tcp://127.0.0.1:4420", TransportAddress("tcp", "127.0.0.1", 4420)),
    ("127.0.0.1", TransportAddress("tcp", "127.0.0.1", 8009)),
    ("10.0.0.1:1234", TransportAddress("tcp", "10.0.0.1", 1234)),
    ("rdma://[fe80::1]:4421", TransportAddress("rdma", "fe80::1", 4421)),
    ("[::1]", TransportAddress("tcp", "::1", 8009)),
    ("localhost:99", TransportAddress("tcp", "127.0.0.1", 99)),
])
def test_parse_address(text, expected):
    assert parse_address(text, 8009) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("udp://1.2.3.4", "unknown transport"),
    ("1.2.3.4:http", "not a number"),
    ("1.2.3.4:70000", "out of range"),
    ("example.com", "not an IP address"),
    ("[::1", "missing ']'"),
    (":4420", "no host"),
])
def test_parse_address_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_address(text, 4420)


def test_address_str_and_adrfam():
    assert str(TransportAddress("tcp", "::1", 4420)) == "tcp://[::1]:4420"
    assert TransportAddress("tcp", "::1", 4420).adrfam == "ipv6"
    assert TransportAddress("tcp", "1.2.3.4", 4420).adrfam == "ipv4"


def test_sizes():
    assert parse_size("4096") == 4096
    assert parse_size("4k") == 4096
    assert parse_size("1G") == 1 << 30
    assert parse_size("512MiB") == 512 << 20
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert format_size(3 << 30) == "3.0 GiB"
    assert format_size(100) == "100 B"


def test_table():
    out = table(["a", "bb"], [[1, None], ["long", 2]]).splitlines()
    assert out[0] == "a     bb"
    assert out[2] == "1"
    assert out[3] == "long  2"
