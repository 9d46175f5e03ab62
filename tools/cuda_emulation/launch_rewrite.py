"""Rewrites every CUDA launch `kernel<<<grid, block, smem, stream>>>(args);` of a .cu file into
`emu_launch(grid, block, smem, [&]() { kernel(args); });`, which cuda_runtime.h here runs on CPU threads, and
every dynamic shared-memory declaration `extern __shared__ T name[];` into a pointer to the launch's
dynamic shared memory.

    python3 launch_rewrite.py IN.cu OUT.cpp
"""
import re
import sys


def matching_parenthesis(source: str, open_index: int) -> int:
    """Index of the ')' that closes the '(' at open_index."""
    depth = 0
    for index in range(open_index, len(source)):
        if source[index] == "(":
            depth += 1
        elif source[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unbalanced parentheses after offset {open_index}")


def top_level_parts(text: str) -> list[str]:
    """text split at the commas outside parentheses (a launch's grid may be a call with arguments), stripped."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:].strip())
    return parts


def rewrite_launches(source: str) -> str:
    pieces, position = [], 0
    while (chevrons := source.find("<<<", position)) >= 0:
        # The kernel name starts after the statement boundary before the launch.
        statement_start = max(source.rfind(c, 0, chevrons) for c in ";{}") + 1
        config_end = source.index(">>>", chevrons)
        config = top_level_parts(source[chevrons + 3 : config_end])
        grid, block = config[:2]
        shared_bytes = config[2] if len(config) > 2 else "0"
        arguments_open = config_end + 3
        assert source[arguments_open] == "(", "a launch's arguments follow >>> directly"
        arguments_close = matching_parenthesis(source, arguments_open)
        assert source[arguments_close + 1] == ";", "a launch is a statement of its own"
        kernel = source[statement_start:chevrons]
        indent = re.match(r"\s*", kernel).group(0)
        arguments = source[arguments_open + 1 : arguments_close]
        pieces.append(source[position:statement_start])
        pieces.append(f"{indent}emu_launch({grid}, {block}, {shared_bytes}, [&]() {{ {kernel.strip()}({arguments}); }});")
        position = arguments_close + 2
    pieces.append(source[position:])
    return "".join(pieces)


def rewrite_dynamic_shared(source: str) -> str:
    return re.sub(r"extern __shared__ (\w+) (\w+)\[\];",
                  r"\1* const \2 = static_cast<\1*>(emu_dynamic_shared());", source)


if __name__ == "__main__":
    with open(sys.argv[1]) as source_file:
        rewritten = rewrite_dynamic_shared(rewrite_launches(source_file.read()))
    with open(sys.argv[2], "w") as output_file:
        output_file.write(rewritten)
