"""The data of examples/train_vlm.py: pictures of coloured shapes that the script draws itself with torch (no
download, no image library), each with a question about it and its answer, as Qwen2.5-VL takes them.

A scene holds 1 to ``max_objects`` shapes on a dark background, each of another shape and another colour, each in
its own cell of a 3 x 3 grid (a random size and offset within the cell, so shapes never touch), colours jittered.
Its question is one of four kinds, and the answer needs the picture:

    what colour is the circle?      red          (COLOURS)
    which shape is blue?            triangle     (SHAPES)
    where is the square?            top left     (POSITIONS, the cell)
    how many shapes are there?      three        (COUNTS)

The question names a shape or a colour that is in the picture and nothing about the rest, so a model that reads the
text alone answers at chance at best: ``text_only_accuracy`` measures the best such model (the most frequent answer
to each question in the training stream).

Scenes are a pure function of (seed, stream, index): the training stream ``samples(step, batch)`` draws batch ``step``
from the generator of (seed, step), the held-out set from stream -1, so a run sees the same samples whatever its
options, and the held-out samples are none of the training ones (their continuous sizes, offsets and colours are
drawn independently; tests/test_examples.py checks).

Tokens are bytes (0-255) plus the special tokens below. A sample's sequence is the processor's layout, shortened:

    <vision_start> <image> x N <vision_end> question bytes "\\n" answer bytes <end>

with N = (image size / patch)^2 / 4 placeholders (the vision encoder's patches, merged 2 x 2), labels -100 but on
the answer and <end> (the loss and the accuracy are over the answers only), right-padded with <pad> (labels -100;
no attention mask is needed: a causal model's real tokens never attend to later padding).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

END, PAD, IMAGE, VIDEO, VISION_START, VISION_END = range(256, 262)
VOCAB_SIZE = 264  # bytes, the six special tokens, rounded up to a multiple of 8
COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.2), "blue": (0.15, 0.3, 1.0), "yellow": (0.95, 0.9, 0.1),
           "magenta": (0.9, 0.15, 0.9), "cyan": (0.1, 0.85, 0.9)}
SHAPES = ("square", "circle", "triangle", "cross", "diamond", "ring")
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
COUNTS = ("one", "two", "three", "four", "five", "six")
KINDS = ("colour", "shape", "position", "count")
GRID = 3  # cells per side; POSITIONS names them row by row
# The two halves of a position answer, scored apart: its row (top, middle, bottom) and its column (left, centre,
# right). A model that reads where a shape is along one axis only gets a third of the position questions right.
POSITION_AXES = ("position_row", "position_column")
COLOUR_JITTER, BACKGROUND_MAX = 0.08, 0.35  # per channel; the background is a grey from 0 to BACKGROUND_MAX
# A shape's half-width as a fraction of its cell's side: never out of its cell, and several patches wide.
MIN_RADIUS, MAX_RADIUS = 0.22, 0.42
# The processor's pixel normalisation (CLIP's mean and standard deviation), as Qwen2.5-VL models are trained with.
PIXEL_MEAN, PIXEL_STD = (0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758)
TEMPORAL_PATCH, MERGE = 2, 2  # Qwen2.5-VL's temporal_patch_size and spatial_merge_size


@dataclass(frozen=True)
class Shape:
    shape: str
    colour: str
    cell: int  # index into POSITIONS
    centre: tuple[float, float]  # (x, y) in pixels
    radius: float  # half-width in pixels
    rgb: tuple[float, float, float]  # the colour drawn: COLOURS[colour] jittered


@dataclass(frozen=True)
class Sample:
    objects: tuple[Shape, ...]
    background: float
    kind: str
    question: str
    answer: str


def draw_sample(generator: torch.Generator, image_size: int, max_objects: int) -> Sample:
    """One scene and a question about it, from ``generator``'s next numbers."""
    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    count = int(torch.randint(1, max_objects + 1, (), generator=generator))
    shapes = torch.randperm(len(SHAPES), generator=generator)[:count].tolist()
    colours = torch.randperm(len(COLOURS), generator=generator)[:count].tolist()
    cells = torch.randperm(GRID * GRID, generator=generator)[:count].tolist()
    side = image_size / GRID
    objects = []
    for shape, colour, cell in zip(shapes, colours, cells):
        radius = side * uniform(MIN_RADIUS, MAX_RADIUS)
        slack = side / 2 - radius - 1  # a pixel of background to the cell's edge
        centre = tuple(side * (index + 0.5) + uniform(-slack, slack) for index in (cell % GRID, cell // GRID))
        name = list(COLOURS)[colour]
        rgb = tuple(min(max(c + uniform(-COLOUR_JITTER, COLOUR_JITTER), 0.0), 1.0) for c in COLOURS[name])
        objects.append(Shape(SHAPES[shape], name, cell, centre, radius, rgb))
    background = uniform(0.0, BACKGROUND_MAX)
    kind = KINDS[int(torch.randint(len(KINDS), (), generator=generator))]
    asked = objects[int(torch.randint(count, (), generator=generator))]
    question, answer = {
        "colour": (f"what colour is the {asked.shape}?", asked.colour),
        "shape": (f"which shape is {asked.colour}?", asked.shape),
        "position": (f"where is the {asked.shape}?", POSITIONS[asked.cell]),
        "count": ("how many shapes are there?", COUNTS[count - 1]),
    }[kind]
    return Sample(tuple(objects), background, kind, question, answer)


def shape_masks(samples: list[Sample], image_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, K, H, W] booleans: where object k of sample b covers a pixel (K = the most objects of a sample; False
    past a sample's own). Pixel (x, y) is sampled at its centre; y grows downwards (the triangle's apex is up)."""
    slots = max(len(sample.objects) for sample in samples)

    def table(value, empty):
        return torch.tensor([[value(o) for o in s.objects] + [empty] * (slots - len(s.objects)) for s in samples],
                            dtype=torch.float32, device=device)[:, :, None, None]

    cx, cy = table(lambda o: o.centre[0], -1e9), table(lambda o: o.centre[1], -1e9)
    radius = table(lambda o: o.radius, 0.0)
    kind = table(lambda o: SHAPES.index(o.shape), -1.0)
    pixels = torch.arange(image_size, device=device, dtype=torch.float32) + 0.5
    dx, dy = (pixels[None, None, None, :] - cx).abs(), pixels[None, None, :, None] - cy
    ady = dy.abs()
    within = (dx <= radius) & (ady <= radius)
    bar = radius / 3
    distance = (dx.square() + dy.square()).sqrt()
    masks = {
        "square": within,
        "circle": distance <= radius,
        "triangle": within & (2 * dx <= dy + radius),
        "cross": within & ((dx <= bar) | (ady <= bar)),
        "diamond": dx + ady <= radius,
        "ring": (distance <= radius) & (distance >= radius / 2),
    }
    return torch.stack([masks[name] & (kind == index) for index, name in enumerate(SHAPES)]).any(dim=0)


def render(samples: list[Sample], image_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, 3, H, W] pictures in [0, 1]."""
    masks = shape_masks(samples, image_size, device)
    slots = masks.shape[1]
    colours = torch.tensor([[o.rgb for o in s.objects] + [(0.0, 0.0, 0.0)] * (slots - len(s.objects)) for s in samples],
                           device=device)
    images = torch.tensor([s.background for s in samples], device=device)[:, None, None, None].expand(-1, 3, image_size,
                                                                                                        image_size)
    for k in range(slots):  # objects never overlap: the order does not matter
        images = torch.where(masks[:, k, None], colours[:, k, :, None, None], images)
    return images


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """Qwen2.5-VL's pixel_values from [B, 3, H, W] pictures: normalised, cut into patch x patch squares in the
    order of the 2 x 2 merged groups, each repeated to the temporal patch (a still picture is two equal frames), as
    the image processor lays them out: [B * H/patch * W/patch, 3 * 2 * patch * patch]."""
    mean = torch.tensor(PIXEL_MEAN, device=images.device)[:, None, None]
    std = torch.tensor(PIXEL_STD, device=images.device)[:, None, None]
    images = (images - mean) / std
    batch, channels, height, width = images.shape
    grid_h, grid_w = height // patch, width // patch
    patches = images.reshape(batch, channels, grid_h // MERGE, MERGE, patch, grid_w // MERGE, MERGE, patch)
    patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7).unsqueeze(6)  # [B, h/2, w/2, 2, 2, C, (T), p, p]
    patches = patches.expand(-1, -1, -1, -1, -1, -1, TEMPORAL_PATCH, -1, -1)
    return patches.reshape(batch * grid_h * grid_w, channels * TEMPORAL_PATCH * patch * patch)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class ShapesVQA:
    """Batches of (picture, question, answer) samples as model inputs: ``samples(step, batch)`` and ``held_out``."""

    def __init__(self, seed: int, image_size: int, patch: int, max_objects: int, held_out: int):
        if image_size % (patch * MERGE):
            raise SystemExit(f"the image size ({image_size}) must be a multiple of 2 x the patch ({patch}): the "
                             "vision encoder merges its patches 2 x 2")
        if not 1 <= max_objects <= min(len(SHAPES), len(COLOURS), GRID * GRID):
            raise SystemExit(f"max_objects must be 1 to {min(len(SHAPES), len(COLOURS))}: each shape of a scene has "
                             "a shape and a colour of its own")
        self.seed, self.image_size, self.patch, self.max_objects = seed, image_size, patch, max_objects
        self.grid = image_size // patch
        self.image_tokens = self.grid ** 2 // MERGE ** 2
        self.held_out = self.samples(-1, held_out)

    def samples(self, stream: int, count: int) -> list[Sample]:
        generator = torch.Generator().manual_seed((self.seed * 1_000_000_007 + stream) % 2**63)
        return [draw_sample(generator, self.image_size, self.max_objects) for _ in range(count)]

    def train_samples(self, step: int, batch: int) -> list[Sample]:
        return self.samples(step, batch)

    def prompt(self, sample: Sample) -> list[int]:
        image = [VISION_START] + [IMAGE] * self.image_tokens + [VISION_END]
        return image + encode(sample.question + "\n")

    def position_ids(self, length: int) -> torch.Tensor:
        """Qwen2.5-VL's M-RoPE positions (temporal, height, width) of the first ``length`` tokens of a sample, [3,
        length]: <vision_start> at 0, the image tokens at 1 + (0, row, column) in the merged grid, the tokens after
        them (padding too) on from 1 + the grid's side in all three. The same for every sample: the model's
        get_rope_index would compute them sample by sample, with host syncs on a GPU, if not given them."""
        side = self.grid // MERGE
        image = torch.arange(self.image_tokens)
        image = 1 + torch.stack([torch.zeros_like(image), image // side, image % side])
        text = torch.arange(1 + side, 1 + side + length - 1 - self.image_tokens).expand(3, -1)
        return torch.cat([torch.zeros(3, 1, dtype=torch.long), image, text], dim=1)

    def image_inputs(self, samples: list[Sample], device) -> dict:
        return {
            "pixel_values": patchify(render(samples, self.image_size, device), self.patch),
            "image_grid_thw": torch.tensor([[1, self.grid, self.grid]] * len(samples), device=device),
        }

    def batch(self, samples: list[Sample], device) -> dict:
        """Model inputs with labels on the answers, right-padded, and their M-RoPE positions."""
        sequences = [(self.prompt(s), encode(s.answer) + [END]) for s in samples]
        length = max(len(prompt) + len(answer) for prompt, answer in sequences)
        input_ids = torch.full((len(samples), length), PAD, dtype=torch.long)
        labels = torch.full((len(samples), length), -100, dtype=torch.long)
        for row, (prompt, answer) in enumerate(sequences):
            input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            labels[row, len(prompt): len(prompt) + len(answer)] = torch.tensor(answer)
        input_ids = input_ids.to(device)
        return {"input_ids": input_ids, "labels": labels.to(device),
                "position_ids": self.position_ids(length)[:, None].repeat(1, len(samples), 1).to(device),
                "mm_token_type_ids": (input_ids == IMAGE).int(), **self.image_inputs(samples, device)}

    def prompts(self, samples: list[Sample], device) -> dict:
        """The prompts alone (picture and question), left-padded with an attention mask, for generate()."""
        prompts = [self.prompt(s) for s in samples]
        length = max(map(len, prompts))
        input_ids = torch.full((len(samples), length), PAD, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, length - len(prompt):] = 1
        input_ids = input_ids.to(device)
        return {"input_ids": input_ids, "attention_mask": attention_mask.to(device),
                "mm_token_type_ids": (input_ids == IMAGE).int(), **self.image_inputs(samples, device)}

    def longest_answer(self) -> int:
        return max(len(encode(answer)) for answer in (*COLOURS, *SHAPES, *POSITIONS, *COUNTS))


def decode_answer(tokens: list[int]) -> str | None:
    """The answer of generated tokens: the bytes before the first <end>; None without one or with a special token
    before it."""
    if END not in tokens:
        return None
    answer = tokens[: tokens.index(END)]
    return bytes(answer).decode("utf-8", errors="replace") if all(t < 256 for t in answer) else None


def text_only_accuracy(training: list[Sample], held_out: list[Sample]) -> dict[str, float]:
    """The held-out accuracy of the best answers that read the question alone: to each question, its most frequent
    answer in ``training``; per question kind and over all ("all")."""
    answers = collections.defaultdict(collections.Counter)
    for sample in training:
        answers[sample.question][sample.answer] += 1
    right = collections.Counter()
    for sample in held_out:
        seen = answers.get(sample.question)
        right.update(score(sample, seen.most_common(1)[0][0] if seen else None))
    return accuracy_by_kind(held_out, right)


def score(sample: Sample, answer: str | None) -> collections.Counter:
    """1 for the sample's kind where ``answer`` is its answer, and for a position question, 1 for each of
    POSITION_AXES that a named position gets right ("top" for "top left": the row, not the column)."""
    right = collections.Counter({sample.kind: int(answer == sample.answer)})
    if sample.kind == "position" and answer in POSITIONS:
        given, asked = POSITIONS.index(answer), POSITIONS.index(sample.answer)
        right.update({"position_row": int(given // GRID == asked // GRID),
                      "position_column": int(given % GRID == asked % GRID)})
    return right


def accuracy_by_kind(samples: list[Sample], right: collections.Counter) -> dict[str, float]:
    """Accuracies from the counts of :func:`score`: over all samples ("all"), per kind of question asked, and per
    axis of the position questions (POSITION_AXES) where any was asked."""
    asked = collections.Counter(s.kind for s in samples)
    accuracies = {"all": sum(right[kind] for kind in KINDS) / len(samples),
                  **{kind: right[kind] / asked[kind] for kind in KINDS if asked[kind]}}
    if asked["position"]:
        accuracies.update({axis: right[axis] / asked["position"] for axis in POSITION_AXES})
    return accuracies
