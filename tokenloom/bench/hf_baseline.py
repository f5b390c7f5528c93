"""The reference point for `bench throughput --baseline hf`: plain transformers generate.

Same weights, same dtype, same torch threads, same requests, in this process, the way
people serve without an engine: static batches of `batch_size` prompts in workload order,
left-padded, greedy, each batch run to its longest requested output.  That last rule is
exactly what continuous batching removes -- a finished request's slot idles until the
whole batch is done -- so only the tokens each request asked for are counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tokenloom.measure.workloads import BenchRequest


@dataclass
class HFRun:
    duration_s: float
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int  # requested tokens actually produced (padding/overshoot not counted)
    generated_tokens: int  # everything generate() produced, idle slots included
    batch_size: int
    num_batches: int

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(
            request_throughput=self.num_requests / self.duration_s,
            output_throughput=self.total_output_tokens / self.duration_s,
            total_token_throughput=(self.total_input_tokens + self.total_output_tokens) / self.duration_s,
            wasted_fraction=1.0 - self.total_output_tokens / self.generated_tokens if self.generated_tokens else 0.0,
        )
        return d


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-config chatter is not a result
    transformers.logging.disable_progress_bar()  # a weight-loading bar would interleave with ours
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_generate(model: Any, reqs: Sequence[BenchRequest], *, batch_size: int = 8, ignore_eos: bool = True,
                    pad_token_id: int = 0, eos_token_ids: Sequence[int] = (), progress: bool = False) -> HFRun:
    """Time static-batch greedy `model.generate` over `reqs`."""
    device = next(model.parameters()).device
    batches = [list(reqs[i:i + batch_size]) for i in range(0, len(reqs), batch_size)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="hf generate", unit="req", dynamic_ncols=True)
    counted = generated = 0
    t0 = time.perf_counter()
    for batch in batches:
        width = max(r.prompt_len for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's last prompt token lines up
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        kw: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad_token_id,
                                  num_beams=1, temperature=None, top_p=None, top_k=None)
        if ignore_eos:
            kw["min_new_tokens"] = new  # suppresses EOS: HF's equivalent of ignore_eos
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kw)
        gen = out[:, width:].cpu()
        generated += gen.numel()
        for i, r in enumerate(batch):
            row = gen[i, : r.output_len].tolist()
            if not ignore_eos:
                for j, t in enumerate(row):
                    if t in eos_token_ids:
                        row = row[: j + 1]
                        break
            counted += len(row)
        if bar is not None:
            bar.update(len(batch))
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return HFRun(duration_s=duration, num_requests=len(reqs), total_input_tokens=sum(r.prompt_len for r in reqs),
                 total_output_tokens=counted, generated_tokens=generated, batch_size=batch_size,
                 num_batches=len(batches))
