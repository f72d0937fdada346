"""A chat's second turn through a server-like Decoder (rows reserved): its time to first token with
the first turn's K/V retained (new) and without (retains off), alternating, in one process."""
import sys, time
import selfspec
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_suite
model, tok = selfspec.load(progress=False)
length = sys.argv[1] if len(sys.argv) > 1 else "1k"
REP = int(sys.argv[2]) if len(sys.argv) > 2 else 2
prompts = [p for p in read_suite("long") if p["length"] == length and p["id"].startswith("chat")][:2]
for p in prompts:
    msgs = p["prompt"]
    for rep in range(REP):
        for way in (("new", "old") if rep % 2 == 0 else ("old", "new")):
            dec = Decoder(model, [], DecodeConfig(max_new_tokens=32), batch_size=4, eos_token_id=None)
            dec.reserve(prompt_tokens=1200 if length == "1k" else 3300, max_new_tokens=64)
            dec.cache.retains = way == "new"
            ids1 = encode_prompt(tok, msgs)
            t0 = time.perf_counter(); s1 = dec.add(ids1)
            first1 = None
            while dec.busy:
                for row, piece in dec.turn():
                    first1 = first1 or time.perf_counter()
            ans = tok.decode(s1.emitted, skip_special_tokens=True)
            turn2 = (msgs if isinstance(msgs, list) else [{"role": "user", "content": msgs}]) + [
                {"role": "assistant", "content": ans}, {"role": "user", "content": "Say that again in one sentence."}]
            ids2 = encode_prompt(tok, turn2)
            t1 = time.perf_counter(); s2 = dec.add(ids2); first2 = None
            while dec.busy:
                for row, piece in dec.turn():
                    first2 = first2 or time.perf_counter()
            alone = selfspec.generate(model, tok, turn2, max_new_tokens=32) if rep == 0 and way == "new" else None
            eq = "" if alone is None else f" = generate: {tok.decode(s2.emitted) == alone.text or s2.emitted == alone.token_ids}"
            print(f"{p['id']} {way}: turn 1 {len(ids1)} tokens ttft {first1 - t0:.3f} s; turn 2 {len(ids2)} tokens ttft {first2 - t1:.3f} s, prefill forwards {s2.stats.prefill_forwards}{eq}", flush=True)
