"""The multimodal workload: scikit-learn digits with 0-6 images and a caption per sample, an
image encoder on stage 0 and the GPT decoder after it (rrfp issue 13)."""

from __future__ import annotations

import pytest
import torch

from rrfp.data.digits import collate, load_digit_images, make_digit_microbatches, make_digit_samples
from rrfp.model.gpt import IGNORE_INDEX, count_tokens, lm_loss
from rrfp.model.multimodal import MULTIMODAL, build_multimodal_stage
from rrfp.runtime.doors.local import LocalPipeline

from reference import ATOL, RTOL, assert_stage_grads, reference_run


@pytest.fixture(scope="module")
def digits():
    return load_digit_images()


def test_digits_ship_with_scikit_learn(digits):
    images, labels = digits
    assert images.shape == (1797, 8, 8) and len(labels) == 1797
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert sorted(set(labels)) == list(range(10))


def test_captions_name_their_images_and_counts_vary(digits):
    _, labels = digits
    samples = make_digit_samples(labels, 500, seed=3)
    for s in samples:
        assert s.caption == b">" + " ".join(str(labels[i]) for i in s.images).encode() + b"."
    assert {len(s.images) for s in samples} == set(range(7))


def test_collate_hand_computed(digits):
    images, labels = digits
    from rrfp.data.digits import DigitSample

    a = DigitSample((5, 7), b">5 7.")
    b = DigitSample((), b">.")
    mb = collate([a, b], images)
    assert mb.counts.tolist() == [2, 0]
    torch.testing.assert_close(mb.images, images[[5, 7]])
    assert mb.tokens.tolist() == [list(b">5 7"), list(b">") + [0, 0, 0]]
    ig = IGNORE_INDEX
    # K = 2 image slots, then caption[1:].
    assert mb.targets.tolist() == [[ig, ig] + list(b"5 7."), [ig, ig, ord(".")] + [ig] * 3]
    assert mb.n_tokens == 5


def _reference(mbs, seed):
    total = sum(count_tokens(mb.targets) for mb in mbs)
    return reference_run(build_multimodal_stage(MULTIMODAL, 1, 0, seed), lambda full: sum(
        lm_loss(full(*mb.inputs), mb.targets) * count_tokens(mb.targets) / total for mb in mbs))


@pytest.mark.slow
@pytest.mark.parametrize("hint", ["bfw-df", "strict-1f1b"])
def test_pipeline_gradients_equal_one_stage_reference(digits, hint):
    images, labels = digits
    samples = make_digit_samples(labels, 12, seed=1)
    mbs = make_digit_microbatches(samples, images, 4)
    assert len({int(mb.counts.sum()) for mb in mbs}) > 1  # encoder work differs per microbatch
    ref_loss, ref_grads = _reference(mbs, seed=2)
    stages = [build_multimodal_stage(MULTIMODAL, 4, s, 2) for s in range(4)]
    with LocalPipeline(stages, 4, lm_loss, hint=hint, loss_weight_fn=count_tokens, delay=(0.0, 0.001), seed=4) as pipe:
        loss = pipe.step(microbatches=[mb.inputs for mb in mbs], targets=[mb.targets for mb in mbs])
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_stage_grads(stages, ref_grads)


def test_bad_inputs_are_refused(digits):
    images, _ = digits
    st = build_multimodal_stage(MULTIMODAL, 2, 0, 0)
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts"):
        st(images[:3], torch.tensor([1, 1]), tokens)  # 3 images, counts sum to 2
    with pytest.raises(ValueError, match="images must have shape"):
        st(torch.zeros(2, 4, 4), torch.tensor([1, 1]), tokens)
    with pytest.raises(ValueError, match="expected 1 to 4"):
        build_multimodal_stage(MULTIMODAL, 5, 0, 0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rrfp_train_model_multimodal_short_run_loss_falls():
    # The full default run (40 steps, 4 ranks) is measured in BENCHMARKS.md; this short one
    # checks the command end to end: 2 ranks, 12 steps.
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "rrfp", "train", "--model", "multimodal", "--stages", "2",
                        "--steps", "12", "--batch-size", "16", "--microbatches", "4", "--quiet"],
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("done: 12 steps"))
    first, last = (float(x) for x in line.split("loss ")[1].split(" (")[0].split(" -> "))
    assert last < 0.8 * first, line


def test_rrfp_train_model_multimodal_refuses_data_and_too_many_stages(capsys):
    from rrfp.cli import main

    assert main(["train", "--model", "multimodal", "--data", "x.txt"]) == 2
    assert "--data with --model multimodal" in capsys.readouterr().err
    assert main(["train", "--model", "multimodal", "--stages", "5"]) == 2
    assert "4 layers of model 'multimodal'" in capsys.readouterr().err
