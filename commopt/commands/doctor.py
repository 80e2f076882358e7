"""`commopt doctor`: what this machine runs, and what to change in its network set-up.

$ commopt doctor                      # versions, interfaces, launcher, env, findings
$ commopt doctor --json               # the same as one JSON object
$ commopt doctor --strict             # exit 1 when there is a warning or an error (CI)
$ eval "$(commopt doctor --profile aws-tcp)"   # export a cloud's recommended variables
"""

from __future__ import annotations

import argparse
import json
import sys

from commopt.tables import table

HELP = "check versions, interfaces and network variables; print a cloud profile's environment"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from commopt.network.cloud_profiles import PROFILES

    parser.add_argument(
        "--profile",
        choices=list(PROFILES),
        help="print the environment to export for this cloud, one reason per line: "
        + "; ".join(f"{k}: {v}" for k, v in PROFILES.items()),
    )
    parser.add_argument(
        "--json", action="store_true", help="print the snapshot and findings as JSON"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when any finding is a warning or an error",
    )


def run(args: argparse.Namespace) -> int:
    from commopt.network.cloud_profiles import profile_env, render
    from commopt.network.doctor import diagnose
    from commopt.network.probe import collect_snapshot

    snapshot = collect_snapshot()
    if args.profile:
        print(render(args.profile, profile_env(args.profile, snapshot)))
        return 0
    findings = diagnose(snapshot)
    if args.json:
        json.dump(
            {"snapshot": snapshot, "findings": [f.as_dict() for f in findings]},
            sys.stdout,
            indent=2,
        )
        print()
    else:
        print(format_report(snapshot, findings))
    if args.strict and any(f.severity in ("error", "warning") for f in findings):
        return 1
    return 0


def format_report(snapshot: dict, findings: list) -> str:
    """The human-readable report (pure: a snapshot and its findings in, text out)."""
    lines = ["Versions"]
    for k, v in (snapshot.get("versions") or {}).items():
        lines.append(f"  {k:<20} {v or '-'}")
    interfaces = snapshot.get("interfaces") or []
    lines.append("Network interfaces" + ("" if interfaces else ": none found"))
    if interfaces:
        rows = [
            [
                i["name"],
                i.get("state", "?"),
                f"{i['speed_mbps']} Mbit/s" if i.get("speed_mbps") else "n/a",
                ", ".join(
                    filter(
                        None,
                        [
                            i.get("address"),
                            i.get("driver"),
                            f"mtu {i.get('mtu')}" if i.get("mtu") else None,
                            "loopback" if i.get("loopback") else None,
                        ],
                    )
                ),
            ]
            for i in interfaces
        ]
        lines += _indented(
            table(["name", "state", "speed", "address, driver, mtu"], rows, align="llll")
        )
    rdma = snapshot.get("rdma_devices") or []
    lines.append("RDMA devices" + ("" if rdma else ": none"))
    if rdma:
        lines += _indented(
            table(
                ["name", "kind", "driver"],
                [[d["name"], d["kind"], d.get("driver") or "?"] for d in rdma],
                align="lll",
            )
        )
    plugins = snapshot.get("nccl_net_plugins") or []
    lines.append("NCCL network plugins" + ("" if plugins else ": none found"))
    lines += [f"  {p}" for p in plugins]
    cloud = snapshot.get("cloud")
    vm = snapshot.get("virtualized")
    lines.append(
        f"Machine: {'virtual machine' if vm else 'bare metal' if vm is False else 'unknown'}"
        + (f" on {cloud}" if cloud else "")
    )
    lines.append(f"Launcher: {snapshot.get('launcher') or 'none (a single process)'}")
    env = snapshot.get("env") or {}
    lines.append("Environment" + ("" if env else ": no relevant variables set"))
    for k, v in env.items():
        lines.append(f"  {k}={v}")
    if snapshot.get("mca_params"):
        lines.append("Open MPI parameter files")
        lines += [f"  {k} = {v}" for k, v in snapshot["mca_params"].items()]
    lines.append("")
    if not findings:
        lines.append(
            "Findings: none. The network set-up follows the published practices checked here."
        )
    else:
        lines.append(f"Findings ({len(findings)})")
        for f in findings:
            lines.append(f"  [{f.severity}] {f.code}: {f.message}")
            lines.append(f"      fix: {f.fix}")
            lines.append(f"      source: {f.source}")
    suggestion = {
        "aws": "aws-efa" if any(d.get("kind") == "efa" for d in rdma) else "aws-tcp",
        "gcp": "gcp-fastsocket",
        "azure": "azure-ib",
    }.get(cloud or "", "tcp")
    lines.append("")
    lines.append(f"Recommended environment: commopt doctor --profile {suggestion}")
    return "\n".join(lines)


def _indented(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]
