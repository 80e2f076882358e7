"""The ``commopt`` backend's COMMOPT_* environment: codecs chosen and bad values named."""

import pytest

from commopt.codecs import QSGD, ErrorFeedback
from commopt.integrations.backend import BackendConfig


def test_bits_choose_the_codec():
    assert BackendConfig.from_env({}).codec().name == "qsgd4"
    q = BackendConfig.from_env({"COMMOPT_BITS": "2", "COMMOPT_BUCKET_SIZE": "512"}).codec()
    assert isinstance(q, QSGD) and (q.bits, q.bucket_size) == (2, 512)
    assert BackendConfig.from_env({"COMMOPT_BITS": "16"}).codec().name == "fp16"
    assert BackendConfig.from_env({"COMMOPT_BITS": "32"}).codec() is None
    ef = BackendConfig.from_env({"COMMOPT_BITS": "8", "COMMOPT_ERROR_FEEDBACK": "1"}).codec()
    assert isinstance(ef, ErrorFeedback) and ef.name == "qsgd8+ef"


def test_policy_follows_min_size_dims_and_exclude():
    policy = BackendConfig.from_env(
        {"COMMOPT_MIN_SIZE": "10", "COMMOPT_COMPRESS_1D": "1", "COMMOPT_EXCLUDE": r"^head\.,embed"}
    ).policy()
    assert policy.should_compress("body.weight", (16,))  # 1-D allowed, 16 >= 10
    assert not policy.should_compress("body.weight", (3, 3))  # 9 < 10 elements
    assert not policy.should_compress("head.weight", (64, 64))  # excluded by name
    assert not policy.should_compress("embed.weight", (64, 64))
    assert not BackendConfig.from_env({}).policy().should_compress("x", (4096,))  # 1-D: exact


@pytest.mark.parametrize(
    "env, named",
    [
        ({"COMMOPT_BITS": "3"}, "COMMOPT_BITS=3"),
        ({"COMMOPT_BITS": "four"}, "COMMOPT_BITS='four'"),
        ({"COMMOPT_BUCKET_SIZE": "0"}, "COMMOPT_BUCKET_SIZE=0"),
        ({"COMMOPT_MIN_SIZE": "-1"}, "COMMOPT_MIN_SIZE=-1"),
        ({"COMMOPT_ERROR_FEEDBACK": "maybe"}, "COMMOPT_ERROR_FEEDBACK='maybe'"),
        ({"COMMOPT_BITS": "32", "COMMOPT_ERROR_FEEDBACK": "1"}, "COMMOPT_ERROR_FEEDBACK=1"),
        ({"COMMOPT_EXCLUDE": "("}, "'('"),
    ],
)
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("'", ".")):
        BackendConfig.from_env(env)
