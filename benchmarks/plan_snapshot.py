"""Plans, estimates and measured peaks on a corpus, written byte for byte, to show that a
change which must not change behaviour (a restructuring) did not.

Uses only the public API and tests/zoo.py, so it runs on a checkout from before the change as
well: run it from the root of each checkout and compare the files (or the printed SHA-256)::

    python benchmarks/plan_snapshot.py /tmp/before.txt    # in the old checkout
    python benchmarks/plan_snapshot.py /tmp/after.txt     # in the new one
    cmp /tmp/before.txt /tmp/after.txt

The corpus: every model of tests/zoo.py, a model only the modules rung can plan, GPT-2 and BERT
from small configs (the model's own loss), each at its least memory and at 60% and 35% of its
baseline in both modes, a real step measured at 60%; and a Llama planned on the meta device
against a whole device (``total_mb``). About 90 s on a 2-core CPU.
"""
import hashlib
import sys
import warnings

sys.path.insert(0, ".")
import torch
warnings.simplefilter("ignore")
torch.set_num_threads(1)
import autockpt
from tests import zoo

out = []
def emit(s): out.append(s)

def run(name, build, args, kwargs, loss_fn=None, measure=True, modes=("non_reentrant", "reentrant")):
    for mode in modes:
        torch.manual_seed(0)
        model = build()
        base = autockpt.plan(model, args, example_kwargs=kwargs, mode=mode, loss_fn=loss_fn)
        emit(f"== {name} {mode} least\n{base}")
        for frac in (0.6, 0.35):
            budget = frac * base.baseline_peak_bytes / 2**20
            try:
                p = autockpt.plan(model, args, example_kwargs=kwargs, budget_mb=budget, mode=mode, loss_fn=loss_fn)
                emit(f"== {name} {mode} {frac}\n{p}")
            except autockpt.AutockptError as e:
                emit(f"== {name} {mode} {frac} error {type(e).__name__}: {e}")
                continue
            if measure and frac == 0.6:
                torch.manual_seed(0)
                m = build()
                t = autockpt.apply(m, budget, example_inputs=args, example_kwargs=kwargs, mode=mode, loss_fn=loss_fn)
                r = autockpt.measure(t, args, example_kwargs=kwargs, loss_fn=loss_fn, warmup=0, repeat=1)
                emit(f"   measured peak_activation_bytes={r.peak_activation_bytes}")

# Compiled under a fixed file name: the capture's reasons quote where tracing failed, and the
# snapshot must not depend on where the checkout lies.
_MODELS = """
import torch
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 64)) for _ in range(6))
    def forward(self, x):
        if x.sum() > 0:
            x = -x
        for block in self.blocks:
            x = x + block(x)
        return x
"""
_namespace: dict = {}
exec(compile(_MODELS, "<plan_snapshot models>", "exec"), _namespace)
DataDependent = _namespace["DataDependent"]
run("modules_rung", DataDependent, (torch.randn(32, 64, generator=torch.Generator().manual_seed(0)),), {})

for case in zoo.CASES:
    args, kwargs = case.inputs()
    run(case.name, case.build, args, kwargs, None)

from transformers import GPT2Config, GPT2LMHeadModel, BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM
ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
run("gpt2", lambda: GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=128)),
    (), dict(input_ids=ids, labels=ids, use_cache=False))
run("bert", lambda: BertForMaskedLM(BertConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=512)),
    (), dict(input_ids=ids, labels=ids), modes=("non_reentrant",))
with torch.device("meta"):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    mids = torch.zeros(1, 256, dtype=torch.long)
emit(str(autockpt.plan(llama, example_kwargs=dict(input_ids=mids, labels=mids, use_cache=False), total_mb=2048, optimizer=torch.optim.AdamW(llama.parameters()))))

text = "\n".join(out)
open(sys.argv[1], "w").write(text)
print(hashlib.sha256(text.encode()).hexdigest(), len(out))
