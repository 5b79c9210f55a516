"""Per seed and set: each method's tok/s (generated tokens / wall seconds), and lookahead / suffix."""
import json, sys
from collections import defaultdict
d = json.load(open(sys.argv[1]))
rate = defaultdict(dict)
for m in d['measurements']:
    toks = sum(len(r['output_tokens']) for r in m['requests'])
    secs = sum(r['seconds'] for r in m['requests'])
    rate[(m['dataset'], m['seed'])][m['method']] = toks / secs
print('| set | seed | none | ngram | suffix | lookahead | lookahead / suffix |')
print('|---|---|---|---|---|---|---|')
for (ds, seed), r in sorted(rate.items()):
    cells = ' | '.join(f"{r[k]:.1f}" if k in r else '-' for k in ('none', 'ngram', 'suffix', 'lookahead'))
    print(f"| {ds} | {seed} | {cells} | {r['lookahead'] / r['suffix']:.3f} |")
