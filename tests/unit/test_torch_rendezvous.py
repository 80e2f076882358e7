"""The torch transport's rendezvous settings (the multi-rank cases are in the fault matrix)."""

import pytest

from commopt.comm import torch_dist


def test_rendezvous_timeout_from_argument_env_or_default(monkeypatch):
    monkeypatch.delenv(torch_dist.RENDEZVOUS_TIMEOUT_ENV, raising=False)
    assert torch_dist.rendezvous_timeout() == torch_dist.DEFAULT_RENDEZVOUS_S < 60
    monkeypatch.setenv(torch_dist.RENDEZVOUS_TIMEOUT_ENV, "7.5")
    assert torch_dist.rendezvous_timeout() == 7.5
    assert torch_dist.rendezvous_timeout(3) == 3.0
    monkeypatch.setenv(torch_dist.RENDEZVOUS_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="give seconds"):
        torch_dist.rendezvous_timeout()
    with pytest.raises(ValueError, match="positive"):
        torch_dist.rendezvous_timeout(0)


def test_the_store_socket_listens_on_the_given_address_only():
    sock = torch_dist._listen("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_an_address_of_another_host_falls_back_to_every_interface(capsys):
    assert torch_dist._listen("198.51.100.7", 0) is None  # TEST-NET-2: never this host's
    assert "not an address of this host" in capsys.readouterr().err
