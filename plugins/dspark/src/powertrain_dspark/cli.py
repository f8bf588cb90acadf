"""``powertrain-dspark``: fit DSpark's confidence calibration from logged verifications."""

from __future__ import annotations

import json
import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """DSpark tools."""


@main.command("calibrate")
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Calibration file to write.")
@click.option("--held-out", type=click.FloatRange(0.05, 0.95), default=0.3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffles records before the split.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def calibrate_command(log: str, out: str, held_out: float, seed: int, as_json: bool) -> None:
    """Fit per-position temperatures on LOG (written by an engine with ``[dspark] log``)
    and report the survival's expected calibration error on held-out records."""
    from powertrain_dspark.calibration import Calibration, fit, read_log, split, survival_ece

    try:
        records = read_log(log)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    fitting, held = split(records, held_out, seed)
    if not fitting or not held:
        sys.exit(f"error: {log} has {len(records)} records; calibration needs some to fit and some held out")
    calibration = fit(fitting)
    before, after = survival_ece(held, Calibration()), survival_ece(held, calibration)
    report = {
        "records": {"fit": len(fitting), "held_out": len(held)},
        "temperatures": list(calibration.temperatures),
        "held_out_ece_before": before,
        "held_out_ece_after": after,
    }
    calibration.save(out, report)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{len(fitting)} records fitted, {len(held)} held out -> {out}")
    click.echo(f"{'position':>8} {'temperature':>11} {'ECE before':>10} {'ECE after':>9}")
    for k, temperature in enumerate(calibration.temperatures, start=1):
        click.echo(
            f"{k:>8} {temperature:>11.3f} {before.get(k, float('nan')):>10.4f} {after.get(k, float('nan')):>9.4f}"
        )
