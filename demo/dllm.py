"""Training the embedded text model `tiny-dllm`: composer's LLaDA architecture (bidirectional attention) trained
as a masked-diffusion language model on the addition task of composer/text/tasks.py, written as a diffusers
LLaDA2Pipeline folder (model_index.json, model/ in LLaDA's own weight names, tokenizer/, scheduler/) with a
composer.json stating its sampling defaults.

The objective is LLaDA's supervised one: the prompt stays clean; every answer position (the sum's digits, then
EOS up to `gen_length`) is masked with probability t ~ U(0, 1) drawn per row; the loss is the cross-entropy on the
masked positions weighted by 1 / t, averaged over the answer positions.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from composer.models.llada.config import LLaDAConfig
from composer.models.llada.model import LLaDAModelLM
from composer.text import tasks

SPECIAL = ["<pad>", "<eos>", "<mask>", "<unk>"]
VOCAB = SPECIAL + [str(d) for d in range(10)] + ["+", "="]
PAD, EOS, MASK = 0, 1, 2
PROMPT_TOKENS = 2 * tasks.DIGITS + 2


@dataclass
class DllmTraining:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 384
    gen_length: int = 8
    # the whole answer is one block: the model is trained seeing every answer position (masked or not), which is
    # the window a single block gives at inference (a block of 4 would hide the second half from the first block's
    # forwards, which training never showed it: 17% right instead of 100%)
    block_length: int = 8
    batch_size: int = 256
    lr: float = 2e-3
    minutes: float = 20.0  # the training budget (wall clock)
    max_steps: int = 100_000
    seed: int = 0


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    made = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   mask_token="<mask>", unk_token="<unk>")
    made.chat_template = tasks.CHAT_TEMPLATE  # "123+456=" written as trained
    return made


def encode(text: str) -> list[int]:
    return [VOCAB.index(t) for t in text.split()]


def config(settings: DllmTraining) -> LLaDAConfig:
    return LLaDAConfig(d_model=settings.d_model, n_heads=settings.n_heads, n_layers=settings.n_layers,
                       mlp_hidden_size=settings.mlp_hidden_size, vocab_size=len(VOCAB), rope_theta=10000.0,
                       max_sequence_length=64, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD)


def batch(rng: random.Random, size: int, gen_length: int) -> torch.Tensor:
    rows = []
    for _ in range(size):
        a, b = tasks.training_pair(rng)
        answer = encode(tasks.answer_for(a, b))
        rows.append(encode(tasks.prompt_for(a, b)) + answer + [EOS] * (gen_length - len(answer)))
    return torch.tensor(rows)


def loss_of(model: LLaDAModelLM, clean: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    answer = clean[:, PROMPT_TOKENS:]
    t = torch.rand(clean.shape[0], 1, generator=generator).clamp(min=1e-3)
    masked = torch.rand(answer.shape, generator=generator) < t
    noisy = clean.clone()
    noisy[:, PROMPT_TOKENS:] = torch.where(masked, torch.full_like(answer, MASK), answer)
    logits = model(noisy).logits[:, PROMPT_TOKENS:]
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), answer.reshape(-1), reduction="none")
    return (token_loss.view(answer.shape) * masked / t).sum() / answer.numel()


def train(settings: DllmTraining, log=print) -> LLaDAModelLM:
    torch.manual_seed(settings.seed)
    rng, generator = random.Random(settings.seed), torch.Generator().manual_seed(settings.seed)
    model = LLaDAModelLM(config(settings))
    for p in model.parameters():  # small init, as a Llama's
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01, betas=(0.9, 0.98))
    budget = settings.minutes * 60
    start = time.perf_counter()
    step, average = 0, None
    model.train()
    while step < settings.max_steps:
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            break
        progress = elapsed / budget  # the schedule follows the clock: warm-up, then cosine to 5%
        lr = settings.lr * min(1.0, (step + 1) / 200) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(model, batch(rng, settings.batch_size, settings.gen_length), generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        average = loss.item() if average is None else 0.98 * average + 0.02 * loss.item()
        step += 1
        if step % 200 == 0:
            log(f"step {step} loss {average:.4f} lr {lr:.2e} ({elapsed / 60:.1f} min)")
    log(f"trained {step} steps in {(time.perf_counter() - start) / 60:.1f} min, loss {average:.4f}")
    return model.eval().requires_grad_(False)


def save_folder(model: LLaDAModelLM, path: Path, settings: DllmTraining) -> Path:
    """The LLaDA2Pipeline folder, weights in LLaDA's own names (fp32: a few MiB)."""
    from diffusers import BlockRefinementScheduler
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "model").mkdir(exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model" / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LLaDAModelLM"], "model_type": "llada", **model.config.to_dict()}
    (path / "model" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer().save_pretrained(str(path / "tokenizer"))
    BlockRefinementScheduler(block_length=settings.block_length).save_pretrained(str(path / "scheduler"))
    index = {"_class_name": "LLaDA2Pipeline", "_diffusers_version": "0.42.1",
             "model": ["transformers", "LLaDAModelLM"], "scheduler": ["diffusers", "BlockRefinementScheduler"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    sampling = {"gen_length": settings.gen_length, "block_length": settings.block_length,
                "num_inference_steps": settings.block_length, "threshold": 0.9, "editing_threshold": 0.0,
                "use_chat_template": True}  # threshold 0.9: as right as one token a step, 3x fewer forwards
    (path / "composer.json").write_text(json.dumps({"family": "tiny-dllm", "sampling": sampling}, indent=2) + "\n")
    return path
