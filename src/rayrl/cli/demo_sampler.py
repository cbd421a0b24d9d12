"""The demo's sampling worker: a Ray actor that loads a model directory and samples."""

from __future__ import annotations

import os

import ray


@ray.remote(num_cpus=1)
class Sampler:
    def __init__(self, model_dir: str, rank: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank = rank
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def sample(self, prompts: list[str], seed: int) -> list[dict]:
        import torch

        out = []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, return_tensors="pt")
            torch.manual_seed(seed * 1000 + self.rank * 100 + i)
            gen = self.model.generate(**ids, max_new_tokens=16, do_sample=True, temperature=1.0)
            response = self.tokenizer.decode(
                gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
            )
            out.append(
                {"rank": self.rank, "pid": os.getpid(), "prompt": prompt, "response": response}
            )
        return out
