"""PyTorch's canonical manual-split pipelining example, unchanged except for the import and the
constructor, run by rrfp and by torch.distributed.pipelining in the same 2 processes: equal
outputs, losses, gradients and eval() outputs. Then the keyword-input model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handover import rank_env, run_ranks

N_MB, BATCH, D = 4, 8, 16


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Model(nn.Module):
    """The tutorial's shape: a ModuleDict of layers, an output head; stages delete what they
    do not hold (``del model.layers[...]``, ``model.output = None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer(D) for i in range(4)})
        self.output = nn.Linear(D, 5)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x) if self.output is not None else x


def _stage_module(rank: int) -> Model:
    torch.manual_seed(0)
    model = Model()
    if rank == 0:
        for i in ("2", "3"):
            del model.layers[i]
        model.output = None
    else:
        for i in ("0", "1"):
            del model.layers[i]
    return model


def _loss_fn(output, target):
    return F.cross_entropy(output, target)


def _example(PipelineStage, Schedule, rank, world, x, y, **extra):
    """PyTorch's documented pattern (docs: "Option 1: splitting a model manually"),
    verbatim but for the two names passed in."""
    stage_mod = _stage_module(rank)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = Schedule(stage, n_microbatches=N_MB, loss_fn=_loss_fn, **extra)
    losses = []
    if rank == 0:
        output = schedule.step(x)
    else:
        output = schedule.step(target=y, losses=losses)
    grads = {n: p.grad.clone() for n, p in stage_mod.named_parameters()}
    eval_losses = []
    if rank == 0:
        eval_out = schedule.eval(x)
    else:
        eval_out = schedule.eval(target=y, losses=eval_losses)
    grads_after_eval = {n: p.grad.clone() for n, p in stage_mod.named_parameters()}
    return schedule, dict(output=output, losses=losses, grads=grads, eval_out=eval_out, eval_losses=eval_losses,
                          grads_after_eval=grads_after_eval)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, D, generator=g), torch.randint(0, 5, (BATCH,), generator=g)

    from torch.distributed.pipelining import PipelineStage as TorchStage, ScheduleGPipe

    _, ref = _example(TorchStage, ScheduleGPipe, rank, world, x, y)
    dist.barrier()

    from rrfp import Pipeline, PipelineStage

    results = []
    for hint in ("bf", "GPipe"):  # two pipelines in one process, each with its own job id
        pipe, got = _example(PipelineStage, Pipeline, rank, world, x, y, hint=hint)
        pipe.close()
        results.append((pipe.job, got))
    torch.save({"ref": ref, "rrfp": results}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pytorch_canonical_example_matches_pytorch_across_two_processes(tmp_path):
    world = 2
    assert run_ranks(_rank_main, world, str(tmp_path), timeout_s=560) == [0] * world
    first, last = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world))
    assert first["rrfp"][0][0] != first["rrfp"][1][0]  # a job id per pipeline
    for rank, res in enumerate((first, last)):
        ref = res["ref"]
        for job, got in res["rrfp"]:
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6)
                # eval() runs forwards only: the gradients are exactly as the step left them.
                # (Not compared with PyTorch's: its eval() divides .grad by n_microbatches again.)
                assert torch.equal(got["grads_after_eval"][name], got["grads"][name])
            if rank == 0:
                assert got["output"] is None and got["eval_out"] is None and ref["output"] is None
            else:
                assert got["output"].shape == (BATCH, 5)
                torch.testing.assert_close(got["output"], ref["output"].detach(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got["eval_out"], ref["eval_out"].detach(), rtol=1e-5, atol=1e-6)
                assert len(got["losses"]) == len(ref["losses"]) == N_MB
                for a, b in zip(got["losses"], ref["losses"]):
                    torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
                assert len(got["eval_losses"]) == len(ref["eval_losses"]) == N_MB
                for a, b in zip(got["eval_losses"], ref["eval_losses"]):
                    torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ keyword inputs


class MaskedAttention(nn.Module):
    """A HuggingFace-style block: ``forward(hidden_states, attention_mask=None)``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        return hidden_states + self.proj(torch.softmax(scores, -1) @ v)


class Embed(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = MaskedAttention(d)

    def forward(self, input_ids, attention_mask=None):
        return self.block(self.emb(input_ids), attention_mask=attention_mask)


class Head(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.block = MaskedAttention(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, hidden_states, attention_mask=None):
        return self.lm_head(self.block(hidden_states, attention_mask=attention_mask))


def _masked_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


@pytest.mark.parametrize("hint,n_mb", [("bf", 4), ("bfw", 3), ("strict-1f1b", 4)])
def test_keyword_inputs_reach_every_stage_without_rewriting_forward(hint, n_mb):
    from rrfp import LocalPipeline

    torch.manual_seed(3)
    stages = [Embed(), MaskedAttention(), MaskedAttention(), Head()]
    ids = torch.randint(0, 11, (10, 6))
    mask = torch.ones(10, 6, dtype=torch.long)
    mask[::2, 4:] = 0  # padded samples
    target = torch.where(mask.bool(), torch.randint(0, 11, (10, 6)), torch.tensor(-100))
    ref = copy.deepcopy(stages)
    h = ref[0](ids, attention_mask=mask)
    for m in ref[1:]:
        h = m(h, attention_mask=mask)
    # The unpipelined loss of equal-size microbatches' mean: per-microbatch token means
    # weighted by their share of the batch (tensor_split sizes).
    parts = list(zip(torch.tensor_split(h, n_mb), torch.tensor_split(target, n_mb)))
    ref_loss = sum(_masked_loss(hm, tm) * len(tm) for hm, tm in parts) / len(target)
    ref_loss.backward()
    with LocalPipeline(stages, n_mb, _masked_loss, hint=hint, delay=(0.0, 0.002)) as pipe:
        out = pipe.step(ids, target=target, attention_mask=mask, return_outputs=True)
    torch.testing.assert_close(torch.tensor(pipe.last_loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, h.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(stages, ref):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    # Without the mask the model computes something else: the keyword input really arrived.
    with LocalPipeline(copy.deepcopy(stages), n_mb, _masked_loss) as pipe:
        unmasked = pipe.eval(ids)
    assert not torch.allclose(unmasked, out)
