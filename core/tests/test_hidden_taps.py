"""Hidden-state taps (issue 53): a drafter declares which of the target's hidden states it reads
(``HiddenTap``), and each step hands it exactly those, with the rows of the step.

The oracle for a Llama layer's output is transformers' ``output_hidden_states`` (entry ``i + 1``
is layer ``i``'s output, except the last, which transformers returns normed). V4.1's and V4's
forms are checked by what they must equal by definition (the streams entering layer 0 are
the embedding four times; the streams before the hyper head give the final hidden state
through it), on the models' own tiny checkpoints. Taps recorded in captured decode steps are
checked with the graphs (``testing.graphs.check_decode_graphs``, the Triton pack's test).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from powertrain import LLM, SamplingParams
from powertrain.assemble import AssemblyError
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import HiddenTap, ModelContext, TapRecorder
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM
from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM
from powertrain.models.llama import LlamaForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import random_hf_model, tiny_tokenizer, write_tiny_deepseek_v4
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41
from powertrain.testing.paged import PagedRunner

#: float32, the same arithmetic as transformers in another order (the Llama model tests' bound).
TOLERANCE = 1e-5
LAYERS = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Llama folder (transformers' save_pretrained, the tiny tokenizer) and its HF model."""
    seed = fresh_seed()
    print(f"checkpoint seed={seed}")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tiny_tokenizer().get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    hf = random_hf_model(transformers.LlamaForCausalLM, config)
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder, hf


def hf_layer_outputs(hf: Any, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states


def ours(folder: Path) -> LlamaForCausalLM:
    checkpoint = load_checkpoint(str(folder))
    context = ModelContext(
        config=checkpoint.config, dtype=torch.float32, device=torch.device("cpu"), attention=TorchReferenceAttention()
    )
    model = LlamaForCausalLM(context)
    model.load_weights(checkpoint.tensors())
    return model


def test_a_recorder_keeps_what_was_asked_and_names_what_never_came() -> None:
    taps = (HiddenTap(2, "layer_output"), HiddenTap(0, "layer_output"))
    recorder = TapRecorder(taps)
    assert recorder.wants(0, "layer_output") and not recorder.wants(1, "layer_output")
    value = torch.randn(3, 4, generator=torch.Generator().manual_seed(fresh_seed()))
    recorder.record(0, "layer_output", value)
    value.zero_()  # the forward may reuse its buffer: the recorder holds a copy
    with pytest.raises(RuntimeError, match=r"no value for hidden taps \[HiddenTap\(layer=2"):
        recorder.taken()
    recorder.record(2, "layer_output", torch.ones(3, 4))
    first, second = recorder.taken()
    assert torch.equal(first, torch.ones(3, 4)) and bool(second.abs().sum() > 0)
    with pytest.raises(ValueError, match="hidden tap form 'logits'; one of layer_output"):
        HiddenTap(0, "logits")


def test_llama_layer_outputs_equal_transformers_hidden_states(llama: tuple[Path, Any]) -> None:
    folder, hf = llama
    model = ours(folder)
    prompts = {"a": random.sample(range(3, 300), 17), "b": random.sample(range(3, 300), 5)}
    model.taps = TapRecorder([HiddenTap(layer, "layer_output") for layer in range(LAYERS - 1)])
    PagedRunner(model, TorchReferenceAttention()).step(list(prompts.items()))
    tapped = model.taps.taken()
    rows = torch.split(torch.stack(tapped), [17, 5], dim=1)
    for (name, tokens), got in zip(prompts.items(), rows, strict=True):
        expected = torch.stack(hf_layer_outputs(hf, tokens)[1:LAYERS])[:, 0]
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_the_engine_hands_a_drafter_its_taps_every_step(
    llama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafter declaring a tap gets, in every ``observe``, one tensor with the step's rows:
    at the prompt's step, transformers' layer output at every prompt position."""
    scripted = pytest.importorskip("powertrain_dspark.scripted")
    import powertrain_dspark.plugin

    folder, hf = llama
    prompt = random.sample(range(3, 300), 11)
    with LLM(str(folder), dtype="float32", prefix_caching=False) as llm:
        (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    answer = list(plain.outputs[0].token_ids)
    seen: list[tuple[int, torch.Tensor]] = []
    build = scripted.scripted({tuple(prompt): answer})

    def tapping(*args: Any) -> Any:
        drafter = build(*args)
        drafter.taps = (HiddenTap(1, "layer_output"),)
        drafter.observe = lambda step: seen.append((len(step.input_ids), step.taps[0]))
        return drafter

    monkeypatch.setattr(powertrain_dspark.plugin, "make_drafter", tapping)
    with LLM(str(folder), dtype="float32", speculative="fixed-k", prefix_caching=False) as llm:
        (speculated,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(speculated.outputs[0].token_ids) == answer
    assert len(seen) > 1 and all(tap.shape == (rows, 64) for rows, tap in seen)
    expected = hf_layer_outputs(hf, prompt)[2][0]
    torch.testing.assert_close(seen[0][1], expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_tap_the_model_does_not_record_is_refused_at_startup(
    llama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = pytest.importorskip("powertrain_dspark.scripted")
    import powertrain_dspark.plugin

    build = scripted.scripted({})

    def tapping(*args: Any) -> Any:
        drafter = build(*args)
        drafter.taps = (HiddenTap(0, "streams_mean_in"), HiddenTap(LAYERS, "layer_output"))
        return drafter

    monkeypatch.setattr(powertrain_dspark.plugin, "make_drafter", tapping)
    with pytest.raises(AssemblyError) as refused:
        LLM(str(llama[0]), dtype="float32", speculative="fixed-k")
    message = str(refused.value)
    assert "reads 'streams_mean_in' at layer 0; LlamaForCausalLM records layer_output" in message
    assert f"reads 'layer_output' at layer {LAYERS}; LlamaForCausalLM has layers 0..{LAYERS - 1}" in message


def test_v41_streams_entering_a_layer_and_v4_streams_before_the_head(tmp_path: Path) -> None:
    """V4.1 without Engram: the streams entering layer 0 are four copies of the embedding, so
    their mean is the embedding itself. V4: the streams before the hyper head, collapsed by it
    and normed, are the model's final hidden state."""
    checkpoint = load_checkpoint(str(write_tiny_deepseek_v41(tmp_path / "v41", seed=0, engram_layer_ids=[])))
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
        tensor_files=checkpoint.tensor_files,
        tokenizer=checkpoint.tokenizer,
    )
    v41 = DeepseekV41ForCausalLM(context)
    v41.load_weights(checkpoint.tensors(wanted=v41.wants_weight))
    tokens = random.sample(range(3, 500), 9)
    v41.taps = TapRecorder([HiddenTap(0, "streams_mean_in"), HiddenTap(4, "streams_mean_in")])
    PagedRunner(v41, TorchReferenceAttention()).step([("a", tokens)])
    entering, later = v41.taps.taken()
    assert torch.equal(entering, v41.embed(torch.tensor(tokens))) and later.shape == entering.shape
    assert not torch.allclose(later, entering)

    checkpoint = load_checkpoint(str(write_tiny_deepseek_v4(tmp_path / "v4", seed=fresh_seed())))
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )
    v4 = DeepseekV4ForCausalLM(context)
    v4.load_weights(checkpoint.tensors())
    layers = json.loads((tmp_path / "v4" / "config.json").read_text())["num_hidden_layers"]
    v4.taps = TapRecorder([HiddenTap(layers, "head_streams")])
    runner = PagedRunner(v4, TorchReferenceAttention(), block_size=8)
    metadata, positions = runner.metadata([("a", tokens)])
    with torch.inference_mode():
        final = v4(torch.tensor(tokens), positions, runner.caches, metadata)
    (streams,) = v4.taps.taken()
    hidden = v4.args.hidden_size
    assert streams.shape == (len(tokens), v4.args.hc_mult * hidden)
    torch.testing.assert_close(v4.norm(v4.hc_head(streams.view(len(tokens), -1, hidden))), final)
