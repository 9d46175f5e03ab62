# Rewrites kernel<<<grid, block, smem, stream>>>(args); into emu_launch(grid, block, [&] { kernel(args); });
import re, sys
src = open(sys.argv[1]).read()
out = []; pos = 0
while True:
    i = src.find('<<<', pos)
    if i < 0: out.append(src[pos:]); break
    j = max(src.rfind(';', 0, i), src.rfind('{', 0, i), src.rfind('}', 0, i)) + 1
    k = src.index('>>>', i)
    cfg = [c.strip() for c in src[i+3:k].split(',')]
    m = k + 3; assert src[m] == '('
    depth = 0; e = m
    while True:
        if src[e] == '(': depth += 1
        elif src[e] == ')':
            depth -= 1
            if depth == 0: break
        e += 1
    args = src[m+1:e]; assert src[e+1] == ';'
    kernel = src[j:i]; lead = re.match(r'\s*', kernel).group(0)
    out.append(src[pos:j] + f'{lead}emu_launch({cfg[0]}, {cfg[1]}, [&]() {{ {kernel.strip()}({args}); }});')
    pos = e + 2
open(sys.argv[2], 'w').write(''.join(out))
