"""Endpoints handed to other nodes: a wildcard bind advertises an address of this machine that can be dialled."""

import socket

from k3serve.netaddr import WILDCARDS, advertised_host


def test_a_bound_host_is_advertised_as_is():
    assert advertised_host("127.0.0.1") == "127.0.0.1"


def test_a_wildcard_bind_advertises_one_of_this_machines_addresses():
    host = advertised_host("0.0.0.0")
    assert host not in WILDCARDS
    with socket.socket() as s:  # bindable: it belongs to this machine
        s.bind((host, 0))
