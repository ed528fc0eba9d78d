"""LoRA on a text model: a PEFT adapter (saved by peft itself) on the tiny LLaDA2 folder's model gives the ids
diffusers' LLaDA2Pipeline gives with the same adapter applied by peft; set_lora / unset_lora switch it between
requests, and unset gives the base model's ids back; merged (lora_fuse) gives the same ids."""

from __future__ import annotations

import pytest
import torch

from composer import TextGenerator
from composer.testing.tiny_llada2 import build_tiny_llada2

pytestmark = pytest.mark.slow
PROMPT = "what is two plus two ?"
SETTINGS = {"gen_length": 16, "num_inference_steps": 4, "temperature": 1.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada2")


@pytest.fixture(scope="module")
def adapter(folder, tmp_path_factory):
    """A PEFT adapter on q/v/o projections with non-zero up matrices, saved by peft (its own file and naming)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder / "model")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    peft_model.save_pretrained(out)
    return out


def _reference_ids(folder, adapter, seed):
    from diffusers import DiffusionPipeline
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(folder / "model")
    model = PeftModel.from_pretrained(base, adapter) if adapter is not None else base
    pipe = DiffusionPipeline.from_pretrained(folder, model=model, tokenizer=AutoTokenizer.from_pretrained(
        folder / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), **SETTINGS).sequences[0].tolist()


def test_a_peft_adapter_gives_the_reference_ids_and_switches(folder, adapter):
    file = adapter / "adapter_model.safetensors"
    with_lora = _reference_ids(folder, adapter, seed=0)
    base = _reference_ids(folder, None, seed=0)
    assert with_lora != base  # the adapter changes the answer
    loaded = TextGenerator.from_pretrained(folder, progress=False, lora_path=[str(file)])
    assert loaded.generate_text(PROMPT, seed=0, **SETTINGS).token_ids == with_lora
    fused = TextGenerator.from_pretrained(folder, progress=False, lora_path=[str(file)], lora_fuse=True)
    assert fused.generate_text(PROMPT, seed=0, **SETTINGS).token_ids == with_lora  # merged into the weights
    gen = TextGenerator.from_pretrained(folder, progress=False)
    assert gen.generate_text(PROMPT, seed=0, **SETTINGS).token_ids == base
    assert "lora0" in gen.set_lora(file) or gen.pipeline.lora_adapters("model").active
    assert gen.generate_text(PROMPT, seed=0, **SETTINGS).token_ids == with_lora
    gen.unset_lora()
    assert gen.generate_text(PROMPT, seed=0, **SETTINGS).token_ids == base
