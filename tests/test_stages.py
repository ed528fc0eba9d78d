"""Stage contract: checks name stage/field/value/rule, never read tensor data by default, timing, errors."""

from __future__ import annotations

import pytest
import torch

from composer.batch import ForwardBatch
from composer.errors import InvalidInputError, StageVerificationError
from composer.stages.base import Stage, StageInvariantError
from composer.stages.denoising import DenoisingStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.text_encoding import TextEncodingStage, clean_prompt
from composer.stages.validators import V, VerificationResult


def _batch(**kwargs):
    return ForwardBatch(prompt=["a cat"], **kwargs)


def test_an_input_check_is_an_assertion_naming_stage_field_value_and_rule():
    """A user's request is checked at submit (composer.request_check); a stage's input check that fails is a bug,
    an AssertionError, not a user's InvalidInputError, and it says where."""
    stage = InputValidationStage(spatial_multiple=16, temporal_factor=4)
    with pytest.raises(StageInvariantError) as info:
        stage(_batch(height=100, width=64, num_frames=9))
    err = info.value
    assert isinstance(err, AssertionError) and not isinstance(err, InvalidInputError)
    assert err.stage == "InputValidationStage"
    assert err.failures == [("height", "100", "a positive multiple of 16 (nearest valid: 96)")]
    assert str(err).startswith("InputValidationStage: input invariant broken (height = 100: expected a positive "
                               "multiple of 16 (nearest valid: 96)); the request check at submit refuses")
    import pickle  # it crosses processes (parallel/workers.py) whole

    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.failures == err.failures


def test_every_failed_check_is_reported_at_once():
    stage = InputValidationStage(spatial_multiple=16, temporal_factor=4)
    with pytest.raises(StageInvariantError) as info:
        stage(ForwardBatch(prompt=[""], height=65, width=0, num_frames=10, num_inference_steps=0,
                           guidance_scale=float("nan"), seed=-1))
    fields = [f for f, _, _ in info.value.failures]
    assert fields == ["prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale", "seed"]
    assert "4k+1 (nearest valid: 9)" in str(info.value)


def test_checks_read_metadata_only_so_meta_tensors_pass():
    """Meta tensors have no data: any check that read values (a device sync on GPU) would raise."""
    meta = torch.device("meta")
    batch = _batch(guidance_scale=5.0)
    batch.latents = torch.empty(1, 16, 3, 8, 8, device=meta)
    batch.timesteps = torch.empty(4, device=meta)
    batch.scheduler = object()
    batch.prompt_embeds = torch.empty(1, 512, 32, device=meta)
    batch.negative_prompt_embeds = torch.empty(1, 512, 32, device=meta)
    stage = DenoisingStage(engine=None)
    stage.check(batch, "input")
    stage.check(batch, "output")  # includes V.all_finite, skipped unless values are checked
    latent_stage = LatentPreparationStage(16, 4, 8, meta)
    batch.num_frames, batch.height, batch.width = 9, 64, 64
    latent_stage.check(batch, "output")


def test_value_checks_run_when_switched_on():
    batch = _batch()
    batch.latents = torch.full((1, 16, 3, 8, 8), float("nan"))
    stage = DenoisingStage(engine=None)
    stage.check(batch, "output")  # default: no value checks
    stage.check_values = True
    with pytest.raises(StageVerificationError, match="latents = Tensor.*expected finite values"):
        stage.check(batch, "output")


def test_validators_describe_tensors_without_values():
    result = VerificationResult().add_check("x", torch.zeros(2, 3), V.shape([2, None, 4]))
    assert result.failures == [("x", "Tensor(shape=[2, 3], dtype=float32, device=cpu)", "a tensor of shape [2, *, 4]")]


class _Boom(Stage):
    def forward(self, batch):
        raise RuntimeError("kernel failed")


class _Ran:
    """A typed piece of request state."""


class _Sleepy(Stage):
    def forward(self, batch):
        batch.attach(_Ran())
        return batch


def test_stage_errors_keep_type_and_traceback_and_name_the_stage():
    with pytest.raises(RuntimeError, match="kernel failed") as info:
        _Boom()(_batch())
    assert any("_Boom" in note for note in getattr(info.value, "__notes__", []))


def test_stage_timing_accumulates_per_stage():
    batch = _Sleepy()(_batch())
    batch = _Sleepy()(batch)
    assert isinstance(batch.get(_Ran), _Ran) and batch.timings["_Sleepy"] > 0


class _CountingEncoder(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, ids, mask):
        self.calls.append(ids.shape[0])
        return self.inner(ids, mask)


def test_text_encoding_cache_gives_identical_embeddings_and_skips_the_encoder(composer_gen):
    stage = composer_gen.pipeline.stage("TextEncodingStage")
    counting = _CountingEncoder(stage.text_encoder)
    cached = TextEncodingStage(counting, stage.tokenizer, stage.max_length)
    uncached = TextEncodingStage(stage.text_encoder, stage.tokenizer, stage.max_length, cache_size=0)

    first = cached.encode(["a red circle", "bright tones", "a red circle"])
    assert counting.calls == [2]  # the repeated prompt is encoded once
    second = cached.encode(["bright tones", "a red circle"])
    assert counting.calls == [2]  # both from the cache
    reference = uncached.encode(["a red circle", "bright tones"])
    assert torch.equal(second[1], reference[0]) and torch.equal(second[0], reference[1])
    assert torch.equal(first[0], first[2])
    # zero past the prompt's length, as Wan was trained
    n_tokens = len(stage.tokenizer("a red circle").input_ids)
    assert reference[0, n_tokens:].abs().max() == 0 and reference[0, :n_tokens].abs().max() > 0


def test_prompt_cleaning_matches_the_reference():
    assert clean_prompt("  a &amp;amp; b \n\t c  ") == "a & b c"


class _Source(Stage):
    """Streams three pieces, slowly; fails on the third when asked to."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def stream(self, batch, upstream):
        import time

        for i in range(3):
            time.sleep(0.02)
            if self.fail and i == 2:
                raise RuntimeError("block failed")
            yield i


class _Double(Stage):
    streams_from_upstream = True

    def stream(self, batch, upstream):
        for piece in upstream:
            yield 2 * piece


def test_streaming_stages_chain_and_time_only_their_own_work():
    batch = _batch()
    source = _Source()
    pieces = list(_Double().iter_call(batch, source.iter_call(batch)))
    assert pieces == [0, 2, 4]
    assert batch.timings["_Source"] >= 0.05
    assert batch.timings["_Double"] < 0.02  # the upstream's sleeps are not the doubler's time


def test_an_upstream_error_is_named_once_after_the_stage_it_arose_in():
    batch = _batch()
    with pytest.raises(RuntimeError, match="block failed") as info:
        list(_Double().iter_call(batch, _Source(fail=True).iter_call(batch)))
    notes = [n for n in getattr(info.value, "__notes__", []) if "pipeline stage" in n]
    assert notes == ["(raised in pipeline stage _Source)"]
