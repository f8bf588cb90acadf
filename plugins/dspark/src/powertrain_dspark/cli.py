"""``powertrain-dspark``: fit DSpark's confidence calibration from logged verifications,
train the MTP drafter's confidence head, and train a block drafter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    """Fit per-position temperatures and biases on LOG (written by an engine with ``[dspark] log``)
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
        "biases": list(calibration.biases),
        "held_out_ece_before": before,
        "held_out_ece_after": after,
    }
    calibration.save(out, report)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{len(fitting)} records fitted, {len(held)} held out -> {out}")
    click.echo(f"{'position':>8} {'temperature':>11} {'bias':>7} {'ECE before':>10} {'ECE after':>9}")
    for k, (temperature, bias) in enumerate(zip(calibration.temperatures, calibration.biases, strict=True), start=1):
        click.echo(
            f"{k:>8} {temperature:>11.3f} {bias:>7.3f} "
            f"{before.get(k, float('nan')):>10.4f} {after.get(k, float('nan')):>9.4f}"
        )


@main.command("train-confidence-head")
@click.option("--model", required=True, help="A DeepSeek checkpoint folder with MTP layers.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False), help="A text file, one prompt per line.")
@click.option(
    "--num-prompts", type=click.IntRange(1), help="Instead: this many prompts of random token ids (a smoke test)."
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Head file to write (safetensors).")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True, help="Tokens per prompt.")
@click.option("--draft-tokens", type=click.IntRange(1, 16), default=5, show_default=True, help="Drafts per step.")
@click.option(
    "--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="Sampling temperature (0: greedy)."
)
@click.option("--steps", type=click.IntRange(1), default=300, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=1e-3, show_default=True)
@click.option("--width", type=click.IntRange(1), default=64, show_default=True, help="The head's hidden width.")
@click.option("--held-out", type=click.FloatRange(0.05, 0.95), default=0.25, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def train_confidence_head_command(
    model: str,
    prompts: str | None,
    num_prompts: int | None,
    out: str,
    max_tokens: int,
    draft_tokens: int,
    temperature: float,
    steps: int,
    lr: float,
    width: int,
    held_out: float,
    dtype: str,
    seed: int,
    as_json: bool,
) -> None:
    """Generate with the MTP drafter verifying DRAFT_TOKENS drafts per step, log each
    verified draft's features and acceptance probability 1 - ½‖p_draft - p_target‖₁,
    train the head with binary cross-entropy to it, and report held-out BCE and
    expected calibration error next to the raw confidence's (the draft's max probability)."""
    import random

    from powertrain_dspark.training import log_and_train

    if (prompts is None) == (num_prompts is None):
        raise click.UsageError("give --prompts FILE or --num-prompts N")
    texts: list = []
    if prompts is not None:
        texts = [line for line in Path(prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            sys.exit(f"error: {prompts} holds no prompts")
    else:
        rng = random.Random(seed)
        texts = [[rng.randrange(2, 256) for _ in range(rng.randint(8, 32))] for _ in range(num_prompts or 0)]
    try:
        report = log_and_train(
            model,
            texts,
            out,
            max_tokens=max_tokens,
            draft_tokens=draft_tokens,
            temperature=temperature,
            steps=steps,
            lr=lr,
            width=width,
            held_out=held_out,
            dtype=dtype,
            seed=seed,
            progress=None if as_json else click.echo,
        )
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(_training_report(report))
    click.echo(f"wrote {out}; use it with [dspark] confidence_head = {out!r}")


def _training_report(report: dict) -> str:
    held = report["held_out"]
    lines = [
        f"logged drafts: {report['drafts']} (mean acceptance probability {report['mean_acceptance']:.3f})",
        f"training loss: {report['train_loss_first']:.4f} -> {report['train_loss_last']:.4f}",
        "held-out      BCE      ECE",
        f"  head     {held['head']['bce']:.4f}   {held['head']['ece']:.4f}",
        f"  raw      {held['raw']['bce']:.4f}   {held['raw']['ece']:.4f}   (max draft probability, no head)",
        f"  constant {held['constant']['bce']:.4f}   {held['constant']['ece']:.4f}   (the mean training label)",
        "position  drafts  head BCE  head ECE  raw ECE",
    ]
    for k, row in sorted(report["by_position"].items()):
        head, raw = row["head"], row["raw"]
        lines.append(f"{k:>8}  {row['drafts']:>6}  {head['bce']:>8.4f}  {head['ece']:>8.4f}  {raw['ece']:>7.4f}")
    return "\n".join(lines)


@main.command("train-drafter")
@click.option("--model", required=True, help="The target: a GGUF file, a HF checkpoint folder or an embedded name.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Drafter folder to write.")
@click.option("--responses", type=click.IntRange(2), default=512, show_default=True, help="Responses to generate.")
@click.option("--max-tokens", type=click.IntRange(2), default=256, show_default=True, help="Tokens per response.")
@click.option("--temperature", type=click.FloatRange(0), default=0.7, show_default=True)
@click.option(
    "--copy-share",
    type=click.FloatRange(0, 1),
    help="Fraction of prompts asking to repeat or rework a given text (default: every task alike).",
)
@click.option("--layers", help="Target layers to tap, e.g. 1,10,19,28 (default: --taps layers spread evenly).")
@click.option("--taps", type=click.IntRange(1), default=4, show_default=True, help="How many target layers to tap.")
@click.option("--num-layers", type=click.IntRange(1), default=1, show_default=True, help="The drafter's layers.")
@click.option("--block-size", type=click.IntRange(1, 16), default=7, show_default=True)
@click.option("--markov-rank", type=click.IntRange(0), default=64, show_default=True)
@click.option("--mask-token-id", type=click.IntRange(0), default=0, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=1000, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", type=click.IntRange(1), default=4, show_default=True, help="Sequences per step.")
@click.option("--anchors", type=click.IntRange(1), default=32, show_default=True, help="Blocks per sequence.")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=6e-4, show_default=True)
@click.option("--held-out", type=click.FloatRange(0.01, 0.9), default=0.1, show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def train_drafter_command(
    model: str,
    out: str,
    responses: int,
    max_tokens: int,
    temperature: float,
    copy_share: float | None,
    layers: str | None,
    taps: int,
    num_layers: int,
    block_size: int,
    markov_rank: int,
    mask_token_id: int,
    steps: int,
    batch_size: int,
    anchors: int,
    lr: float,
    held_out: float,
    dtype: str,
    seed: int,
    as_json: bool,
) -> None:
    """Train DeepSeek's DSpark block drafter for MODEL with DeepSpec's objective on text MODEL
    writes itself (its hidden states recorded through the engine's taps), report held-out
    acceptance, and write it in DeepSpec's format for ``[dspark] drafter = "block"``."""
    from powertrain_dspark.block_training import TrainSettings, train_drafter

    try:
        layer_ids = [int(x) for x in layers.split(",")] if layers else None
    except ValueError:
        raise click.UsageError(f"--layers {layers!r}: give comma-separated layer numbers") from None
    settings = TrainSettings(steps=steps, batch_size=batch_size, num_anchors=anchors, lr=lr, seed=seed)
    try:
        report = train_drafter(
            model, out, responses=responses, max_tokens=max_tokens, temperature=temperature,
            layer_ids=layer_ids, num_taps=taps, num_layers=num_layers, block_size=block_size,
            markov_rank=markov_rank, mask_token_id=mask_token_id, settings=settings, held_out=held_out,
            dtype=dtype, copy_share=copy_share, progress=None if as_json else click.echo,
        )  # fmt: skip
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(_drafter_report(report))
    click.echo(f"wrote {out}; use it with [dspark] drafter = 'block', draft_model = {out!r}")


def _drafter_report(report: dict) -> str:
    before, after = report["held_out_before"], report["held_out_after"]
    lines = [
        f"training loss: {report['train_loss_first']:.4f} -> {report['train_loss_last']:.4f}",
        "held-out             loss      CE      L1  confidence  E[accepted]  E[accepted, greedy]",
    ]
    for name, row in (("before training", before), ("after training", after)):
        lines.append(
            f"  {name:<16} {row['loss']:.4f} {row['ce']:7.3f} {row['l1']:7.3f} {row['confidence']:11.4f}"
            f" {row['expected_accepted']:12.3f} {row['expected_accepted_greedy']:20.3f}"
        )
    lines.append("position  accept rate (1 - L1/2)  greedy agreement")
    for k, (rate, agree) in enumerate(zip(after["accept_rate"], after["greedy_agreement"], strict=True), start=1):
        lines.append(f"{k:>8}  {rate:>22.3f}  {agree:>16.3f}")
    return "\n".join(lines)
