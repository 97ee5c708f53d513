#!/usr/bin/env python3
"""The host emulator's source rewrite (docs/testing.md): turns a CUDA source into C++ that the
emulator headers compile. Usage: rewrite_launches.py IN OUT"""
import re
import sys


# The rewrites:
#   kernel<<<grid, block, smem, stream>>>(args);  ->  emu::launch(emu::kernel_id(kernel), dim3(grid),
#                                                                dim3(block), smem, stream,
#                                                                [&] { kernel(args); });
#   (nullptr for the kernel when smem is 0; otherwise `kernel` must name one function, with its
#   template arguments spelled out, since the emulator checks its cudaFuncSetAttribute)
#   extern __shared__ T name[];                   ->  T* name = reinterpret_cast<T*>(emu::dyn_smem());
#   __shared__                                    ->  static (blocks run one at a time)
def rewrite(src):
    src = re.sub(r'extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+(?:\s+[\w:]+)*?)\s+(\w+)\[\];',
                 r'\1* \2 = reinterpret_cast<\1*>(emu::dyn_smem());', src)
    src = src.replace('__shared__', 'static')
    out = []
    i = 0
    while True:
        j = src.find('<<<', i)
        if j < 0:
            out.append(src[i:])
            return ''.join(out)
        # The kernel expression before <<<: a name with template arguments, possibly on the
        # previous line; it starts after the statement boundary.
        k = j
        while src[k - 1] in ' \t\n':
            k -= 1
        depth = 0
        while k > 0:
            c = src[k - 1]
            if c == ')' and depth == 0:
                break
            if c in '>)':
                depth += 1
            elif c in '<(':
                if depth == 0:
                    break
                depth -= 1
            elif c in ';{}\n' and depth == 0:
                break
            k -= 1
        while src[k] in ' \t':
            k += 1
        kernel = src[k:j]
        e = src.find('>>>', j)
        config = [x.strip() for x in re.split(r',(?![^()]*\))', src[j + 3:e])]
        config += ['0', 'nullptr'][len(config) - 2:]
        p = e + 3
        while src[p] in ' \t\n':
            p += 1
        if src[p] != '(':
            sys.exit(f'rewrite_launches: no argument list after >>> near: {src[j - 60:p + 20]!r}')
        depth, q = 0, p
        while True:
            if src[q] == '(':
                depth += 1
            elif src[q] == ')':
                depth -= 1
                if depth == 0:
                    break
            q += 1
        out.append(src[i:k])
        call = f'{kernel}{src[p:q + 1]}'.replace('\n', ' ')
        # The kernel's identity, for the dynamic shared memory check; launches with none need no
        # name that resolves to one function (a template deducing its arguments from the call).
        kid = 'nullptr' if config[2] == '0' else f"emu::kernel_id({' '.join(kernel.split())})"
        out.append(f'emu::launch({kid}, dim3({config[0]}), dim3({config[1]}), {config[2]}, '
                   f'{config[3]}, [&] {{ {call}; }})')
        out.append('\n' * src[k:q + 1].count('\n'))  # keep the line numbers of what follows
        i = q + 1


if __name__ == '__main__':
    with open(sys.argv[1]) as f:
        text = f.read()
    with open(sys.argv[2], 'w') as f:
        f.write(f'#line 1 "{sys.argv[1]}"\n' + rewrite(text))
