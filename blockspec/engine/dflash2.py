"""DFlash2 speculative decoding: an external block-diffusion drafter proposes block_size - 1 tokens in one pass.

The drafter reads the target's intermediate features (outputs of its target_layer_ids) of committed positions
only: prefill chunks and the committed rows of each verification pass are appended to its bounded context.
The proposal length comes from the drafter checkpoint's block size (self_speculative_num_tokens does not change it).
"""

from __future__ import annotations

import re

import torch

from ..drafter.config import DrafterConfig
from ..drafter.model import DFlash2Drafter
from ..quant.apply import prepare, rtn
from .decode import Proposer

DRAFTER_PROJECTIONS = re.compile(r"fc$|layers\.\d+\.(self_attn|mlp)\.")  # what dflash2_quantization quantizes


class DFlash2Proposer(Proposer):
    name = "dflash2"

    def __init__(self, drafter: DFlash2Drafter):
        self.drafter = drafter
        self.capture_layers = tuple(drafter.target_layer_ids)
        self.max_proposals = drafter.block_size - 1

    @classmethod
    def build(cls, engine) -> "DFlash2Proposer":
        model = engine.model
        shared = dict(embed=model.embed, lm_head=model.logits, device=engine.device, dtype=engine.dtype)
        if engine.config.dflash2_model:
            drafter = DFlash2Drafter.from_pretrained(
                engine.config.dflash2_model, target_hidden_size=model.config.hidden_size,
                target_vocab_size=model.config.vocab_size, target_num_layers=model.config.num_hidden_layers, **shared)
        else:  # synthetic benchmark: the published drafter's shapes around this target, random weights
            from ..synthetic import synthetic_drafter_config, randomize_
            drafter = DFlash2Drafter(DrafterConfig.from_dict(synthetic_drafter_config(model.config)), **shared)
            randomize_(drafter, engine.synthetic_drafter)
        # norms, convolution controls and the selector stay native: only fc and the layers' projections
        quantizer = rtn(engine.config.dflash2_quantization, 32, engine.dtype)
        engine.memory["drafter"] = prepare(drafter, engine.packs, quantizer, DRAFTER_PROJECTIONS.match)
        return cls(drafter)

    def reset(self):
        self.drafter.reset()

    def observe(self, out, first, tokens, next_tokens):
        self.drafter.append_context(out.features[:len(tokens)], first)

    def propose(self, anchor, position, k):
        if self.graph is None:
            return self.drafter.propose(anchor, position)[:k].tolist()
        self.anchor.fill_(anchor)
        self.position.fill_(position)
        self.graph.replay()
        return self.proposals[:k].tolist()

    graph = None

    def capture_graph(self, warmup: int = 2):
        """Record the whole proposal (embedding, layers, convolutions, logits, selector walk) as one CUDA graph over
        a static anchor and position; prepared at load time (compile_mode 0)."""
        device = self.drafter.device
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.drafter.propose(self.anchor, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.proposals = self.drafter.propose(self.anchor, self.position)
