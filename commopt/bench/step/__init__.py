"""Training steps side by side: PyTorch DDP and commopt on the same model, batch and link.

    commopt bench step                                   # both models, every configuration
    commopt bench step --models mlp --configs ddp-fp32,commopt-qsgd4-db --rounds 1
    commopt bench step --models tiny --no-link --steps 3 --warmup 1 --rounds 1

One job of ``-n`` ranks per model runs under ``commopt launch``: on an emulated cluster of
hosts joined by ``--link`` links, one rank per host, or on plain loopback, said so, where
network namespaces are unavailable. Inside the job every configuration gets, in turn, a
fresh model (same seed: same initial weights and batches), a fresh DDP or commopt wrapper
and optimizer, its warm-up and timed steps, and is torn down before the next. The whole
list runs ``--rounds`` times, configuration after configuration, so a change in the load
of the machine during the run hits every configuration alike; each figure is the median
over rounds of a round's median step. A job that fails (a configuration that crashes or
hangs past ``--collective-timeout``) is restarted without that configuration.

Compute-only time is measured beside every configuration: each rank also trains a twin
of the model with the plain optimizer and no communication, every rank at once, right after
each block of ``--block`` timed distributed steps (commopt's double-buffering pipeline is
drained by ``flush()`` before, and restarted by one untimed step after, which every
configuration takes so that all train the same steps). That is one
rank's throughput alone, at the same moment and under the same sharing of this machine's
cores as the distributed steps (the emulated hosts share the real CPUs, and other jobs'
load comes and goes), so efficiency and comm wait are paired measurements.

Columns of the table (one per model):

- step time: median time of a training step (forward, backward, optimizer step), and in
  brackets the lowest and highest of the rounds' medians: how much the load moved it;
- compute: median time of the twin's step (the same work without communication);
- rank CPU: processor time one rank's process (all its threads: compute, the collectives'
  worker, the transport's threads) used per step: the share of wall time it kept a core busy
  during the timed steps, times the median step. The emulated hosts share this
  machine's cores (as many cores as hosts here, not pinned): a value near or above the step
  time says the step is bound by the processor, not by the link;
- link limit: the time the link needs for this configuration's gradient allreduce,
  2(n-1)/n x wire bytes / rate: the physical limit beside the measured time;
- codec: one step's codec arithmetic on one rank (encode and decode at the kernels' speed,
  PowerSGD's factorisation, fp16 casts), measured on every rank at once after the blocks;
- floor: max(compute + codec, link limit), what no schedule can remove on these hosts;
  step/floor the measured step over it; bound: the floor's larger term (link or processor);
- samples/s: n x per-rank batch / step time;
- speed-up: DDP fp32's step time / this step time;
- efficiency: e = t / (t0 n), t the samples/s of the n ranks, t0 that of one rank alone
  (the twin): compute / step time, per block, median over blocks and rounds;
- comm wait: 1 - efficiency, the share of a step spent beyond compute: waiting for the
  network and the CPU work of sending (copies, codecs);
- final loss: cross-entropy on a fixed held-out batch after the last step (first round).

``--profile`` runs a few more steps of each configuration under ``torch.profiler`` and
reports each thread's time per phase and its CPU (``commopt.bench.profile_step``,
``commopt.bench.profile_report``).

The JSON (``--json``) also holds every step time, the time to the end of backward (DDP waits
for its last buckets inside backward, and so does commopt with overlap; with double buffering nothing waits), each rank's medians and losses.

Configurations: DDP fp32 (gloo), DDP with ``fp16_compress_hook``, DDP with the
PowerSGD hook at rank 1 and 4 (one bucket: see ``POWERSGD_BUCKET_MB``); commopt with fp32,
fp16, qsgd4 and qsgd4 + error feedback, each with overlap (reduction during backward) and
with double buffering (``-db``: reduction during the next step).

The modules, one job each: ``configs`` (what each configuration is, its wire bytes, how a rank
builds it), ``models`` (the models and their synthetic tasks), ``worker`` (one rank of a job),
``driver`` (the jobs under ``commopt launch``, the emulated link, restarts), ``figures`` (the
arithmetic from raw timings), ``floor`` (the codec time and the floor), ``report`` (tables, markdown, JSON, plot), ``sim_export``
(``--sim-measurements`` for the simulator's validation) and ``cli`` (the options).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> parser.parse_args(["--configs", "ddp-fp32,commopt-qsgd4-db"]).configs
    'ddp-fp32,commopt-qsgd4-db'
"""

from __future__ import annotations

from commopt.bench.step.cli import add_arguments, run
from commopt.bench.step.configs import CONFIGS, DEMO_CONFIGS
from commopt.bench.step.models import MODELS

__all__ = ["CONFIGS", "DEMO_CONFIGS", "MODELS", "add_arguments", "run", "run_driver"]


def run_driver(args):
    """Run every (model, configuration) of ``args``; print and return the report (a dict, as
    written by ``--json``)."""
    from commopt.bench.step.driver import run_driver as _run

    return _run(args)
