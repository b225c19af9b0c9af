import types, json, os
from dataclasses import replace
import torch
import profile_cycle as pc
from timing import event_ms
from blockspec.bench import bytes_per_plain_step, measure_read_bandwidth
from blockspec.engine.decode import prefill
from blockspec.engine.target import GraphedTarget
from blockspec.kernels import use
from blockspec.quant import w4a16_triton as wq

new_default = wq.default_config
def old_default(m, n, k, bits=4, group_size=128):
    c = new_default(m, n, k, bits, group_size)
    return replace(c, split=0, waves=4) if c.split else c

bw = measure_read_bandwidth(torch.device("cuda"))
out = {"bandwidth": bw}
for quant, vq in (("fp8", "none"), ("int4", "int8")):
    args = types.SimpleNamespace(context_length=4096, quant=quant, vocab_quant=vq, no_fold_norms=False, pdl_level=None)
    engine = pc.build_engine("none", args)
    prompt = torch.randint(0, engine.model.config.vocab_size, (512,), device="cuda")
    with use(engine.kernels):
        for label in ("new", "old", "new again", "old again"):
            wq.default_config = old_default if label.startswith("old") else new_default
            wq.UNSPLIT_FILL = 2.0 if label.startswith("old") else 15 / 16
            target = GraphedTarget(engine.model, engine.state, (), lengths=(1,))
            engine.state.reset(); prefill(target, prompt, 0, 512, engine.proposer)
            def step():
                target.verify([0]); engine.state.commit(1)
            ms = event_ms(step, reps=50)
            roof = bytes_per_plain_step(engine) / (bw * 1e9) * 1e3
            out[f"{quant} {label}"] = (round(ms, 4), round(100 * roof / ms, 1))
            print(quant, label, round(ms, 4), "ms", round(100 * roof / ms, 1), "% of roofline", flush=True)

    wq.default_config, wq.UNSPLIT_FILL = new_default, 15 / 16
    del engine; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab.json"), "w"), indent=1)
