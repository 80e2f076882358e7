"""The optimizer's behaviour is unchanged: recorded random call sequences replay identically.

``tests/unit/optimizer_sequences.json`` holds, for random sequences of optimizer calls in
every mode (synchronous with and without overlap, double-buffered, compensated; zero_fill;
codecs; clipping; SGD and Adam), a digest after every call of the weights, the gradients,
the exception raised (type and message) and the counters. Any change in behaviour shows up
as the first call whose digest differs, printed in full.
"""

import json

import pytest

from tests.unit.optimizer_sequences import FIXTURE, run_sequence, short

RECORDED = json.loads(FIXTURE.read_text())


def test_the_fixture_covers_every_schedule_and_raises_somewhere():
    modes = {str(r["mode"]["double_buffering"]) for r in RECORDED["runs"]}
    assert modes == {"False", "True", "compensated"}
    kinds = {k for r in RECORDED["runs"] for k in r["errors"]}
    assert sum(sum(r["errors"].values()) for r in RECORDED["runs"]) > 100  # error paths too
    # Only the errors that name the fix (and torch's own, from GradScaler misuse).
    assert kinds <= {"RuntimeError", "ValueError", "AssertionError"}, kinds


@pytest.mark.parametrize("chunk", range(4))
def test_recorded_sequences_replay_identically(chunk):
    runs = RECORDED["runs"][chunk::4]
    for recorded in runs:
        replay = run_sequence(recorded["seed"], RECORDED["length"])
        assert replay["mode"] == recorded["mode"]
        assert short(" ".join(replay["calls"])) == recorded["calls"], "the call draw changed"
        for i, (got, want) in enumerate(zip(replay["trace"], recorded["trace"].split())):
            assert short(got) == want, (
                f"sequence seed={recorded['seed']} mode={recorded['mode']}: call {i} "
                f"({replay['calls'][i]}) now gives {got!r}; calls so far: {replay['calls'][: i + 1]}"
            )
