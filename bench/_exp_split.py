import json, os
import torch
from timing import replay_ms
from blockspec.quant import w4a16_triton as wq
from kernel_schedules import weights

SH = {"down": (5120, 17408), "out": (5120, 6144), "qkv": (14336, 5120), "gdn_in": (16480, 5120)}
orig = wq.schedule
dev = torch.device("cuda")
res = []
for kind in ("fp8", "int4"):
    bits = 8 if kind == "fp8" else 4
    for name, (n, k) in SH.items():
        packed = weights(kind, n, k, dev)
        nblk = packed[0].q.shape[1] // packed[0].group_size
        tiles = -(-n // 64)
        for m in (1, 8):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cfg = wq.default_config(m, n, k, bits)
            cur = orig(cfg, n, nblk, 132)
            ref = wq.wq_matmul(x, packed[0], cfg, out_dtype=torch.float32)
            seen = set()
            for s in sorted(set([cur[1]] + list(range(1, 19)))):
                bps = -(-nblk // s); s2 = -(-nblk // bps)
                if (s2, bps) in seen or bps < 2: continue
                seen.add((s2, bps))
                wq.schedule = lambda c, nn, nb, sms=132, s2=s2, bps=bps: (0, s2, bps)
                try:
                    us = replay_ms(lambda: [wq.wq_matmul(x, w, cfg) for w in packed]) * 1e3 / len(packed)
                    err = float((wq.wq_matmul(x, packed[0], cfg, out_dtype=torch.float32) - ref).abs().max())
                finally:
                    wq.schedule = orig
                progs = tiles * s2
                busiest = -(-progs // 132) * bps
                r = dict(kind=kind, shape=name, m=m, split=s2, bps=bps, programs=progs, busiest=busiest,
                         us=round(us, 2), gbs=round(packed[0].nbytes() / us / 1e3), current=(0, s2, bps) == cur, err=err)
                res.append(r); print(json.dumps(r), flush=True)
        packed.clear()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "split.json"), "w"), indent=1)
