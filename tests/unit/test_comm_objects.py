"""Objects between ranks as JSON + raw bytes (commopt.comm.objects): round trips, refusals,
and that a hostile message can only fail to decode, never run code."""

import json
import struct

import numpy as np
import pytest
import torch

import commopt
from commopt.comm.objects import decode, encode


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -(2**62),
        1.5,
        float("inf"),
        "text",
        [1, "a", None],
        (1, (2, 3)),
        {"a": 1, "b": [2.0]},
        {0: "int key", (1, 2): "tuple key"},
        {"$tuple": "dollar key"},
        b"\x00\xffraw",
        torch.float16,
        (("model.w", (3, 4), "torch.float32", True),),
    ],
)
def test_plain_values_round_trip(value):
    assert decode(encode(value)) == value
    assert type(decode(encode(value))) is type(value)


def test_tensors_and_arrays_keep_dtype_shape_and_bits():
    t = torch.randn(3, 5).to(torch.bfloat16)
    state = {
        "state": {0: {"momentum_buffer": t, "step": torch.tensor(7)}},
        "rng": torch.get_rng_state(),
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "empty": torch.empty(0, 4),
        "flags": torch.tensor([True, False]),
    }
    back = decode(encode(state))
    assert torch.equal(back["state"][0]["momentum_buffer"], t)
    assert back["state"][0]["momentum_buffer"].dtype == torch.bfloat16
    assert torch.equal(back["rng"], state["rng"]) and back["state"][0]["step"].item() == 7
    assert isinstance(back["np"], np.ndarray) and back["np"].dtype == np.uint32
    assert (back["np"] == state["np"]).all()
    assert back["empty"].shape == (0, 4) and back["flags"].tolist() == [True, False]


def test_nan_survives():
    assert np.isnan(decode(encode(float("nan"))))


@pytest.mark.parametrize(
    "value, hint",
    [
        ({1, 2}, "a list instead"),
        (object(), "its fields as a dict"),
        ({"ns": __import__("argparse").Namespace(a=1)}, "vars(namespace)"),
        ([torch.device("cpu")], "str(device)"),
    ],
)
def test_other_types_are_refused_with_what_to_send(value, hint):
    with pytest.raises(TypeError) as info:
        encode(value)
    assert "never pickle" in str(info.value) and hint in str(info.value)


def test_refusal_names_where_the_bad_value_sits():
    with pytest.raises(TypeError, match=r"obj\['opt'\]\[2\]"):
        encode({"opt": [1, 2, {3}]})


def _message(tree, blob=b""):
    header = json.dumps(tree).encode()
    return struct.pack("<Q", len(header)) + header + blob


@pytest.mark.parametrize(
    "message, error",
    [
        (b"\x01", "shorter than its header"),
        (struct.pack("<Q", 1000) + b"{}", "only"),
        (_message({"$bytes": [0, 100]}, b"abc"), "beyond its end"),
        (_message({"$tensor": ["float32", [4], "cpu", 0, 8]}, b"\x00" * 8), "shape"),
        (_message({"$dtype": "object"}), "unknown dtype"),
    ],
)
def test_hostile_messages_fail_to_decode(message, error):
    with pytest.raises((ValueError, RuntimeError), match=error):
        decode(message)


def test_pickle_payload_is_just_bytes():
    """A pickle that would run code, sent as the whole message, is not unpickled."""
    import os
    import pickle

    evil = pickle.dumps(type("X", (), {"__reduce__": lambda self: (os.system, ("false",))})())
    with pytest.raises((ValueError, UnicodeDecodeError, json.JSONDecodeError)):
        decode(evil)


def test_local_communicator_uses_the_same_contract():
    comm = commopt.create_communicator("local")
    assert comm.allgather_obj(("host", 1)) == [("host", 1)]
    assert comm.bcast_obj({"k": b"v"}) == {"k": b"v"}
    with pytest.raises(TypeError, match="never pickle"):
        comm.allgather_obj({1, 2})


def test_dataclasses_come_back_as_the_receivers_class_or_a_dict():
    import dataclasses

    @dataclasses.dataclass
    class Stats:
        loss: float = 0.0
        ntokens: int = 0

    mine = Stats(1.5, 7)
    assert decode(encode(Stats(2.5, 3)), like=mine) == Stats(2.5, 3)
    assert decode(encode([Stats(2.5, 3)]), like=[mine]) == [Stats(2.5, 3)]
    assert decode(encode(Stats(2.5, 3))) == {"loss": 2.5, "ntokens": 3}  # no class named by a peer
    assert commopt.create_communicator("local").allgather_obj(mine) == [mine]
