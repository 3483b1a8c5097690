"""Oracle analysis of a bench results.json: text identity and ratios (issue 25)."""
import json, math, statistics, sys
r = json.load(open(sys.argv[1]))
by = {}
for run in r['runs']:
    by.setdefault((run['suite'], run['prompt_id']), {})[run['runner']] = run
ours = [n for n in ("off", "lookup/K3", "lookup/K5", "lookup", "lookup/A6") if any(n in v for v in by.values())]
gm = lambda xs: math.exp(statistics.fmean(map(math.log, xs)))
ratios = {n: [] for n in ours}; fixed_vs = {"lookup/K3": [], "lookup/K5": []}
n_prompts = same_plain = winner_same = ours_same = 0
for key, runs in by.items():
    nat = {n: x for n, x in runs.items() if n.startswith('native-') and n != 'native-plain' and x.get('tokens_per_s')}
    if not nat or runs['off']['n_tokens'] < 8:
        continue
    n_prompts += 1
    plain = runs['native-plain']['output_hash']
    win = max(nat, key=lambda n: nat[n]['tokens_per_s'])
    same_plain += runs['off']['output_hash'] == plain
    winner_same += nat[win]['output_hash'] == plain
    ours_same += all(runs[n]['output_hash'] == runs['off']['output_hash'] for n in ours)
    for n in ours:
        ratios[n].append(runs[n]['tokens_per_s'] / nat[win]['tokens_per_s'])
    for k in fixed_vs:
        fixed_vs[k].append(runs['lookup']['tokens_per_s'] / runs[k]['tokens_per_s'])
print(f"prompts with a ratio: {n_prompts}; off's text == native-plain's: {same_plain}; "
      f"the winner's text == native-plain's: {winner_same}; all our runners' text == off's: {ours_same}")
print("| runner | median | geomean | worst | below 0.85x |")
print("| --- | --- | --- | --- | --- |")
for n in ours:
    v = ratios[n]
    print(f"| `{n}` | {statistics.median(v):.2f}x | {gm(v):.2f}x | {min(v):.2f}x | {sum(x < 0.85 for x in v)} |")
for k, v in fixed_vs.items():
    print(f"adaptive `lookup` / `{k}` per prompt: median {statistics.median(v):.2f}x, geomean {gm(v):.2f}x")
offs = [runs['off']['tokens_per_s'] / runs['native-plain']['tokens_per_s'] for runs in by.values() if 'native-plain' in runs and runs['off']['n_tokens'] >= 8]
print(f"`off` / `native-plain` per prompt: median {statistics.median(offs):.2f}x, geomean {gm(offs):.2f}x")
