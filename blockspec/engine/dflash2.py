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
from . import graphs
from .decode import Proposer

DRAFTER_PROJECTIONS = re.compile(r"fc$|layers\.\d+\.(self_attn|mlp)\.")  # what dflash2_quantization quantizes


class DFlash2Proposer(Proposer):
    name = "dflash2"

    def __init__(self, drafter: DFlash2Drafter, draft_head=None):
        self.drafter = drafter
        self.draft_head = draft_head  # proposals over a draft vocabulary (None: the full shared head)
        self.capture_layers = tuple(drafter.target_layer_ids)
        self.max_proposals = drafter.block_size - 1
        self.graph, self.append_graphs = None, {}  # compile_mode 0 only

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
        draft_head = engine.draft_head()
        if draft_head is not None:
            drafter.set_head(draft_head.logits, draft_head.ids)
        return cls(drafter, draft_head)

    def reset(self):
        self.drafter.reset()

    def observe(self, out, first, tokens, next_tokens):
        rows = len(tokens)
        if rows not in self.append_graphs:  # prefill chunks (and eager mode)
            self.drafter.append_context(out.features[:rows], first)
            return
        context = self.drafter.context
        if first != context.length:
            raise ValueError(f"context append at {first}, but {context.length} positions are committed")
        self.features_in[:rows].copy_(out.features[:rows])
        self.append_start.fill_(first)
        self.append_graphs[rows].replay()
        context.length = first + rows

    def propose(self, anchor, position, k):
        if self.graph is None:
            return self.drafter.propose(anchor, position)[:k].tolist()
        self.anchor.fill_(anchor)
        self.position.fill_(position)
        self.graph.replay()
        return self.proposals[:k].tolist()

    def capture_graphs(self, pool=None, warmup: int = 2):
        """compile_mode 0, at load time: the whole proposal (embedding, layers, convolutions, logits, selector walk)
        as one CUDA graph over a static anchor and position, and the context append of each verification length
        (1..block_size committed rows) as one graph each."""
        drafter, device = self.drafter, self.drafter.device
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.graph, self.proposals = graphs.capture(lambda: drafter.propose(self.anchor, self.position), warmup, pool)
        block = drafter.block_size
        width = len(drafter.target_layer_ids) * drafter.config.hidden_size  # the target's captured layers
        self.features_in = torch.zeros(block, width, device=device, dtype=drafter.dtype)
        self.append_start = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = offsets = torch.arange(block, device=device)  # kept: a graph holds no reference to it
        self.append_graphs = {
            rows: graphs.capture(lambda rows=rows: drafter.encode_context(self.features_in[:rows],
                                                                          self.append_start + offsets[:rows]),
                                 warmup, pool)[0]
            for rows in range(1, block + 1)}
        drafter.reset()  # warm-ups wrote scratch context rows
