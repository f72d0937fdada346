import time
from selfspec.checkpoint.convert import smollm2_gguf
from selfspec.tools.peers import LlamaCppPeer
from selfspec.tools.bench_prompts import read_suite
import selfspec
from selfspec.streaming import encode_prompt
_, tok = selfspec.load(progress=False)
ids = encode_prompt(tok, [p for p in read_suite("long") if p["length"] == "1k"][0]["prompt"])
peer = LlamaCppPeer(smollm2_gguf(), threads=2)
kw = dict(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, eos=set(), seed=0)
for name, reset in (("emptied (now)", True), ("as before", False)):
    if not reset:
        peer.llm.reset = lambda: None
    ttft = []
    for _ in range(3):
        peer.run(ids, **kw); ttft.append(round(peer.first_token_seconds, 3))
    print(f"{len(ids)}-token prompt, three runs in a row, llama.cpp first token s, cache {name}: {ttft}")
