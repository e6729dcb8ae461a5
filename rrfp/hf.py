"""Hugging Face ``transformers`` causal LMs as rrfp pipeline stages (``pip install 'rrfp[hf]'``).

    from transformers import AutoModelForCausalLM
    import rrfp.hf

    model = AutoModelForCausalLM.from_pretrained("./my-llama")
    stages = rrfp.hf.split_hf(model, n_stages)        # embeddings on stage 0, head on the last
    stage = rrfp.PipelineStage(stages[rank], rank, n_stages)
    pipe = rrfp.Pipeline(stage, 8, loss_fn, tied=rrfp.hf.hf_ties(model, n_stages))
    pipe.step(input_ids, attention_mask=mask, target=labels)

or, without building the whole model on any rank (meta device, then only this stage's tensors
read from the folder's safetensors files):

    (module,), tied = rrfp.hf.build_hf_stages("./my-llama", n_stages, [rank])

The split itself is :mod:`rrfp.model.hf`.
"""

from .model.hf import FAMILIES, HFStage, build_hf_stages, hf_model, hf_ties, split_hf
from .model.spec import HF_PRESETS

__all__ = ["FAMILIES", "HF_PRESETS", "HFStage", "build_hf_stages", "hf_model", "hf_ties", "split_hf"]
