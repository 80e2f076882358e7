"""`commopt simulate`: predict step time, throughput and parallel efficiency.

$ commopt simulate --machine v100-nvlink-25g --model resnet50 --gpus 32 --compression fp16 --double-buffering
$ commopt simulate --config optimizer.json --gpus 64
$ commopt simulate --model bert-large --sweep gpus=8..1024 --plot scaling.png
$ commopt simulate --profile-model resnet50 --machine testbed-1gbit --gpus 2
$ commopt simulate --machine testbed-1gbit --gpus 2 --compute-time 0.8 --grad-bytes 102760448 --measured-step 1.7
$ commopt simulate --machine v100-nvlink-25g --gpus 16 --nccl-env "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"
$ commopt simulate --machine p100-10gbe --gpus 32 --software chainermn-1.3-pure_nccl-db --compression fp16

The plan's options carry create_multi_node_optimizer's names, and ``--config FILE`` reads the
JSON object of its keywords that the optimizer takes as ``create_multi_node_optimizer(opt,
comm, **json.load(open(FILE)))``.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "predict step time, throughput and parallel efficiency for 1 to 4096 workers"

#: Options renamed to the optimizer's names: the old spelling and the new.
_RENAMED_OPTIONS = {"codec": "--compression", "bucket_mb": "--bucket-cap-mb"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("what to simulate")
    g.add_argument(
        "--machine", default="v100-nvlink-25g", help="preset name or machine JSON file (see --list)"
    )
    g.add_argument(
        "--model",
        default="resnet50",
        help="built-in profile name or profile JSON file (see --list)",
    )
    g.add_argument("--gpus", type=int, default=None, help="number of workers (default: one node)")
    g.add_argument(
        "--sweep",
        default=None,
        metavar="AXIS=VALUES",
        help="sweep one axis: gpus=8..1024 (doubling), inter_gbps=25,100,400, bucket_cap_mb=..., "
        "batch=..., intra_GBps=..., compression=none,fp16,qsgd4, overlap=true,false, "
        "double_buffering=false,true, algorithm=...",
    )
    p = parser.add_argument_group(
        "communication plan (create_multi_node_optimizer's options, under their names)"
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help="a JSON object of create_multi_node_optimizer keywords (algorithm, compression, "
        "allreduce_grad_dtype, bucket_cap_mb, overlap, double_buffering; zero_fill, seed and "
        "clip_grad_norm are accepted and do not change the step time); the options below "
        "override it",
    )
    p.add_argument(
        "--software",
        default=None,
        metavar="NAME",
        help="what named software did (overlap, buffers, copies, algorithm): "
        "chainermn-1.3-pure_nccl, chainermn-1.3-pure_nccl-db, pytorch-ddp, commopt; the options "
        "below override its fields (see --list)",
    )
    p.add_argument(
        "--algorithm",
        default=None,
        help="auto (default): the fastest suitable algorithm for each bucket; native: the "
        "transport's own sum (NCCL's ring or tree); scatter_reduce; hierarchical; ring or tree: "
        "native pinned to one of NCCL's algorithms",
    )
    p.add_argument(
        "--compression",
        default=None,
        metavar="CODEC",
        help="none (default), fp16, bf16, qsgd2, qsgd4, qsgd8, qsgd<bits>b<bucket>; +ef (error "
        "feedback) is predicted as the codec",
    )
    p.add_argument(
        "--allreduce-grad-dtype",
        default=None,
        choices=("float32", "float16", "bfloat16"),
        help="the wire dtype without --compression (as the optimizer's allreduce_grad_dtype)",
    )
    p.add_argument(
        "--codec-bench",
        default=None,
        metavar="FILE",
        help="codec benchmark results (JSON) giving the codec's measured speeds and bytes ratio",
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        metavar="MB",
        help="gradient bucket size in MiB (default 25)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="the all-reduce starts after the backward pass (default: bucket by bucket during it)",
    )
    p.add_argument(
        "--double-buffering",
        nargs="?",
        const=True,
        default=None,
        choices=(True, "compensated"),
        metavar="compensated",
        help="the all-reduce of step t runs during step t+1 (ChainerMN); 'compensated' is timed "
        "as double buffering",
    )
    for old in _RENAMED_OPTIONS:  # earlier spellings: an error that names the new one
        p.add_argument(f"--{old.replace('_', '-')}", dest=f"renamed_{old}", help=argparse.SUPPRESS)
    p.add_argument("--overlap", dest="renamed_overlap", help=argparse.SUPPRESS)
    p.add_argument(
        "--piece-mb",
        type=float,
        default=None,
        help="pieces of the scatter-reduce pipeline in MiB of fp32 (default: "
        "commopt.collectives.PIECE_BYTES, 4 MiB; 0: no pipeline)",
    )
    o = parser.add_argument_group("overrides")
    o.add_argument("--inter-gbps", type=float, default=None, help="inter-node line rate in Gbit/s")
    o.add_argument(
        "--intra-GBps", type=float, default=None, help="intra-node per-GPU bandwidth in GB/s"
    )
    o.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node instead of the preset's (e.g. 1 for one rank per node, as "
        "all_reduce_perf -g 1)",
    )
    o.add_argument(
        "--transport",
        default=None,
        metavar="NAME",
        help="the inter-node transport instead of the preset's (see --list): NCCL version, "
        "sockets / IB verbs / EFA, per-flow cap",
    )
    o.add_argument(
        "--nccl-env",
        default=None,
        metavar="VARS",
        help='NCCL variables as the transport reads them, "NCCL_SOCKET_NTHREADS=4 '
        'NCCL_NSOCKS_PERTHREAD=4", or a `commopt doctor --profile` name (aws-tcp, '
        "gcp-fastsocket, azure-ib, ...); without --algorithm or --software the algorithm "
        "becomes nccl (ring or tree)",
    )
    o.add_argument("--batch", type=float, default=None, help="samples per GPU per step")
    o.add_argument(
        "--throughput", type=float, default=None, help="single-GPU samples/s on this machine's GPU"
    )
    o.add_argument("--step-time", type=float, default=None, help="single-GPU step time in seconds")
    o.add_argument("--grad-dtype", choices=("fp32", "fp16"), default=None, help="gradient width")
    m = parser.add_argument_group("measured inputs")
    m.add_argument(
        "--profile-model",
        default=None,
        metavar="NAME",
        help="profile a real run of NAME (resnet50) on this CPU and simulate with it",
    )
    m.add_argument(
        "--profile-out", default=None, help="where to write the profile (default NAME.profile.json)"
    )
    m.add_argument(
        "--profile-batch", type=int, default=1, help="samples per profiled step (default 1)"
    )
    m.add_argument(
        "--profile-image-size",
        type=int,
        default=64,
        help="image side in pixels for the profiled run (default 64; the profile keeps per-layer "
        "shares, the GPU speed comes from the built-in profile)",
    )
    m.add_argument(
        "--profile-iters",
        type=int,
        default=2,
        help="profiled steps; the fastest counts (default 2)",
    )
    m.add_argument(
        "--profile-threads", type=int, default=1, help="torch threads while profiling (default 1)"
    )
    m.add_argument(
        "--compute-time",
        type=float,
        default=None,
        help="measured compute seconds per step (with --grad-bytes: a synthetic profile)",
    )
    m.add_argument(
        "--grad-bytes", type=float, default=None, help="gradient bytes per step (float32)"
    )
    m.add_argument(
        "--measured-step",
        type=float,
        default=None,
        help="measured step seconds to compare the prediction with",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--plot", default=None, metavar="PNG", help="write a plot (needs matplotlib)")
    out.add_argument(
        "--list", action="store_true", help="list machines, models and codecs, then exit"
    )


def _list() -> int:
    from commopt.sim import (
        get_machine,
        list_codec_costs,
        list_machines,
        list_profiles,
        load_profile,
    )

    print("machines:")
    for name in list_machines():
        print(f"  {name:18s} {get_machine(name).description}")
    print("models:")
    for name in list_profiles():
        print(f"  {name:20s} {load_profile(name).description}")
    print("codecs:", ", ".join(list_codec_costs()))
    from commopt.sim.software import SOFTWARE
    from commopt.sim.transport import TRANSPORTS

    print("software (--software):")
    for name, sw in sorted(SOFTWARE.items()):
        print(f"  {name:28s} {sw.description}")
    print("transports (--transport):")
    for name, t in TRANSPORTS.items():
        print(
            f"  {name:24s} {t.kind}, NCCL {t.nccl_version or '-'}, flows {t.flows}, "
            f"{'GPUDirect RDMA' if t.gdr else 'staged through host'}"
        )
    return 0


def _profile(args, machine):
    from commopt.sim.model_profiles import list_profiles, load_profile
    from commopt.sim.profiler import profile_named_model

    prof = profile_named_model(
        args.profile_model,
        batch=args.profile_batch,
        image_size=args.profile_image_size,
        iterations=args.profile_iters,
        threads=args.profile_threads,
    )
    path = args.profile_out or f"{args.profile_model}.profile.json"
    prof.save(path)
    print(
        f"profiled {args.profile_model} on this CPU: {prof.sources['measured']}; wrote {path}",
        file=sys.stderr,
    )
    if machine.gpu not in prof.throughput and args.profile_model in list_profiles():
        # Measured layer timings, published speed of the machine's GPU.
        from dataclasses import replace

        builtin = load_profile(args.profile_model)
        if machine.gpu in builtin.throughput:
            print(
                f"using the measured per-layer backward shares with the built-in {machine.gpu} "
                "throughput and batch",
                file=sys.stderr,
            )
            prof = replace(
                prof,
                batch_per_gpu=builtin.batch_per_gpu,
                throughput=builtin.throughput,
                grad_bytes_per_param=builtin.grad_bytes_per_param,
            )
    return prof


def _renamed(args) -> str | None:
    """The error for an option given in an earlier spelling, or None."""
    for old, new in _RENAMED_OPTIONS.items():
        if getattr(args, f"renamed_{old}") is not None:
            return f"--{old.replace('_', '-')} is now {new} (create_multi_node_optimizer's name)"
    if args.renamed_overlap is not None:
        new = {"none": "--no-overlap", "double-buffering": "--double-buffering"}.get(
            args.renamed_overlap, "nothing (overlap with the backward pass is the default)"
        )
        return f"--overlap {args.renamed_overlap} is now {new}"
    return None


def _plan_fields(args) -> dict:
    """The plan's fields from --config and the options that override it."""
    from commopt.sim.configuration import config_fields

    config: dict = {}
    if args.config:
        try:
            with open(args.config) as f:
                config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {args.config}: not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {args.config}: expected a JSON object of keywords")
    flags = {
        "algorithm": args.algorithm,
        "compression": args.compression,
        "allreduce_grad_dtype": args.allreduce_grad_dtype,
        "bucket_cap_mb": args.bucket_cap_mb,
        "overlap": False if args.no_overlap else None,
        "double_buffering": args.double_buffering,
    }
    if args.compression is not None:
        config.pop("allreduce_grad_dtype", None)
    elif args.allreduce_grad_dtype is not None:
        config.pop("compression", None)
    config.update({k: v for k, v in flags.items() if v is not None})
    try:
        return config_fields(config)
    except ValueError as exc:
        raise ValueError(f"--config {args.config}: {exc}" if args.config else str(exc)) from None


def run(args) -> int:
    from commopt.sim import (
        Configuration,
        from_benchmark,
        get_machine,
        load_profile,
        parse_sweep,
        run_sweep,
    )
    from commopt.sim.report import format_table, to_json
    from commopt.sim.validation import synthetic_profile

    if args.list:
        return _list()
    renamed = _renamed(args)
    if renamed:
        print(f"commopt simulate: error: {renamed}", file=sys.stderr)
        return 2
    try:
        from commopt.sim.transport import parse_nccl_env

        machine = get_machine(args.machine).with_overrides(
            inter_gbps=args.inter_gbps,
            intra_GBps=args.intra_GBps,
            gpus_per_node=args.gpus_per_node,
            transport=args.transport,
            nccl_env=parse_nccl_env(args.nccl_env) if args.nccl_env else None,
        )
        if (args.compute_time is None) != (args.grad_bytes is None):
            raise ValueError(
                "--compute-time and --grad-bytes go together (a profile from two measured numbers)"
            )
        if args.compute_time is not None:
            profile = synthetic_profile(args.compute_time, args.grad_bytes, device=machine.gpu)
        elif args.profile_model:
            profile = _profile(args, machine)
        else:
            profile = load_profile(args.model)
        profile = profile.with_overrides(
            batch_per_gpu=args.batch,
            gpu=machine.gpu,
            throughput=args.throughput,
            step_time=args.step_time,
            grad_bytes_per_param={"fp32": 4, "fp16": 2, None: None}[args.grad_dtype],
        )
        fields = _plan_fields(args)
        if args.codec_bench:
            fields["compression"] = from_benchmark(
                args.codec_bench, fields.get("compression", "none")
            )
        if args.nccl_env and "algorithm" not in fields and not args.software:
            # NCCL's variables tune NCCL's own algorithms; commopt's hierarchical ring and
            # scatter-reduce run on commopt's communicator, which does not read them.
            fields["algorithm"] = "native"
            print(
                "commopt simulate: --nccl-env tunes NCCL: algorithm native (NCCL's ring or tree) "
                "unless --algorithm is given",
                file=sys.stderr,
            )
        if args.piece_mb is not None:
            fields["piece_mb"] = args.piece_mb
        if args.software:
            from commopt.sim.software import software_plan

            plan = software_plan(args.software, **fields)
        else:
            plan = Configuration(**fields)
        if args.sweep:
            axis, values = parse_sweep(args.sweep)
        else:
            axis, values = "gpus", [args.gpus if args.gpus is not None else machine.gpus_per_node]
        rows = run_sweep(profile, machine, plan, args.gpus, axis, values)
    except (ValueError, FileNotFoundError) as exc:
        print(f"commopt simulate: error: {exc}", file=sys.stderr)
        return 2

    if args.json:
        doc = to_json(rows, axis=axis, machine=machine, model=profile, plan=plan)
        if args.measured_step is not None:
            doc["measured_step_s"] = args.measured_step
            doc["error_vs_measured"] = rows[-1][1].step_s / args.measured_step - 1
        print(json.dumps(doc, indent=1))
    else:
        print(f"{profile.name} on {machine.name} ({machine.description}); {plan.describe()}")
        print(format_table(rows, axis))
        if args.measured_step is not None:
            pred = rows[-1][1].step_s
            print(
                f"measured step {args.measured_step * 1e3:.1f} ms, predicted {pred * 1e3:.1f} ms, "
                f"error {pred / args.measured_step - 1:+.1%}"
            )
    if args.plot:
        try:
            from commopt.sim.plot import plot_sweep

            plot_sweep(
                rows, axis, args.plot, title=f"{profile.name} on {machine.name}: {plan.describe()}"
            )
        except ImportError as exc:
            print(f"commopt simulate: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
