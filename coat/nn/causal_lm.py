"""The fused LM head + loss for transformers' causal LMs (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM, Gemma3ForCausalLM; the mixtures of experts Qwen3MoeForCausalLM,
Qwen2MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, with the router's auxiliary loss added as their forward
adds it when ``output_router_logits``) and vision-language models (LlavaForConditionalGeneration,
LlavaNextForConditionalGeneration, LlavaOnevisionForConditionalGeneration, Mistral3ForConditionalGeneration,
InternVLForConditionalGeneration, Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration,
Gemma3ForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration with its router's loss: the LM head
on the top model, the loss transformers' own, over every position whose label is not ignore_index; a data set
ignores the image tokens by labelling them -100, as with transformers' loss).

A model given the fused loss keeps its class's identity (it becomes an instance of a subclass, e.g.
FusedLossLlamaForCausalLM of LlamaForCausalLM) and its modules, parameters and state dict. Its forward is the
transformers forward, with one change in training mode when ``labels`` are given (as a keyword, as the Trainer
passes them): the LM head computes the loss with :func:`coat.nn.functional.linear_cross_entropy` instead of the
logits, so the [batch, seq, vocab] logits never exist, and the output's ``logits`` is None. In eval mode
(``model.eval()``, as the Trainer's ``evaluate()`` sets it) and without labels (``generate()``) nothing changes:
the stock forward returns the logits, and with labels transformers' loss on them (soft-capped first where the
config says so), the stock model's values exactly. That loss costs nothing more once the logits exist, where
the fused loss would compute the head's GEMM a second time; evaluation with labels holds the logits, as the
stock model's does (Liger-Kernel's rule: logits dropped only in training).

The fused loss is transformers' ForCausalLMLoss: labels shifted by one (or ``shift_labels`` when given), ignore_index
(-100 unless passed), the mean over the tokens not ignored, or the sum over ``num_items_in_batch`` when the
Trainer passes it for gradient accumulation. One difference: a batch whose tokens are all ignored gives loss 0,
not transformers' NaN (it gives 0 already when num_items_in_batch is passed). A model whose config has a
``final_logit_softcapping`` (Gemma 3) gets it in the fused loss, z' = cap * tanh(z / cap), as its forward would
apply it to the logits.

The model's own forward runs unchanged (its keywords, its cache, ``logits_to_keep``), only the LM head's result
differs: the head is swapped for :class:`FusedLossLMHead`, the same nn.Linear (same Parameter, so tied
embeddings stay tied) that, while the model's forward holds labels for it, returns the loss. The weight is read
inside the head's own forward, where FSDP and other hooks on the head have made it whole.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from transformers.models.idefics3.modeling_idefics3 import Idefics3ForConditionalGeneration
from transformers.models.internvl.modeling_internvl import InternVLForConditionalGeneration
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.llava.modeling_llava import LlavaForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextForConditionalGeneration
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionForConditionalGeneration
from transformers.models.mistral3.modeling_mistral3 import Mistral3ForConditionalGeneration
from transformers.models.mistral.modeling_mistral import MistralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
from transformers.models.olmo2.modeling_olmo2 import Olmo2ForCausalLM
from transformers.models.olmoe.modeling_olmoe import OlmoeForCausalLM
from transformers.models.phi3.modeling_phi3 import Phi3ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeForCausalLM
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMForConditionalGeneration

from coat.nn.cross_entropy import linear_cross_entropy
from coat.nn.decoder import CACHE_ARGUMENTS, UNPADDED_CAUSAL

# The forward's arguments that can make its causal mask other than the plain lower triangle (padding, packed
# sequences' positions, a cache that holds tokens, Gemma 3's image tokens attending to each other both ways).
_MASK_ARGUMENTS = ("attention_mask", "position_ids", "cache_position", "token_type_ids", *CACHE_ARGUMENTS)


class FusedLossLMHead(nn.Linear):
    """An LM head that returns the fused loss instead of the logits while ``pending_loss`` holds the loss's
    arguments (set by the model's forward for one call), and the logits otherwise."""

    pending_loss: dict | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.pending_loss is None:
            return super().forward(hidden_states)
        return causal_lm_loss(hidden_states, self.weight, bias=self.bias, **self.pending_loss)


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss on ``hidden_states @ weight.T + bias`` (soft-capped by ``softcap`` when given),
    fused: labels [batch, seq] shifted by one (the last position predicts nothing), or ``shift_labels`` as given,
    against hidden_states [batch, seq, H]."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.numel() != hidden_states.shape[:-1].numel():
        raise ValueError(
            f"coat's fused loss: the labels ({tuple(shift_labels.shape)}) do not match the positions the LM head "
            f"sees ({tuple(hidden_states.shape[:-1])}); with logits_to_keep, pass labels for the kept positions only"
        )
    return linear_cross_entropy(
        hidden_states,
        weight,
        shift_labels.reshape(hidden_states.shape[:-1]).to(hidden_states.device),
        bias=bias,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        softcap=softcap,
    )


def _fused_loss_forward(base_forward):
    """The forward of a model with the fused loss, on top of its transformers class's ``base_forward``; wraps it
    so that inspect.signature (which the Trainer reads to keep dataset columns) sees the base signature."""

    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() and len(args) <= 1 and all(kwargs.get(n) is None for n in _MASK_ARGUMENTS):
            kwargs[UNPADDED_CAUSAL] = True  # the decoder layers may skip the mask transformers builds (coat.nn.decoder)
        if kwargs.get("labels") is None or not self.training:
            # No labels (or positional ones), or eval mode: the stock forward, its logits and transformers' loss.
            return base_forward(self, *args, **kwargs)
        labels = kwargs.pop("labels")
        return_dict = kwargs.pop("return_dict", None)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        self.lm_head.pending_loss = {
            "labels": labels,
            "ignore_index": kwargs.get("ignore_index", -100),
            "shift_labels": kwargs.get("shift_labels"),
            "num_items_in_batch": kwargs.get("num_items_in_batch"),
            "softcap": softcap,
        }
        try:
            if softcap is not None:  # the fused loss caps the logits; the base forward would cap the loss
                self.config.final_logit_softcapping = None
            outputs = base_forward(self, *args, return_dict=True, **kwargs)
        finally:
            self.lm_head.pending_loss = None
            if softcap is not None:
                self.config.final_logit_softcapping = softcap
        loss = outputs.logits
        aux_loss = getattr(outputs, "aux_loss", None)
        if aux_loss is not None:  # MoE models: the router's load-balancing loss, added as their forward adds it
            loss = loss + _router_aux_loss_coef(self) * aux_loss.to(loss.device)
        # A new output rather than assignments: ModelOutput's tuple view keeps the fields it was built with.
        outputs = type(outputs)(**{**outputs, "loss": loss, "logits": None})
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return outputs if return_dict else outputs.to_tuple()

    return forward


def _router_aux_loss_coef(model: nn.Module) -> float:
    """The weight of the router's loss where the model's forward reads it: the causal LMs' attribute, Qwen3-VL-MoE's
    text config."""
    coef = getattr(model, "router_aux_loss_coef", None)
    return model.config.get_text_config().router_aux_loss_coef if coef is None else coef


def _fused_loss_class(base: type) -> type:
    return type(
        f"FusedLoss{base.__name__}",
        (base,),
        {
            "forward": _fused_loss_forward(base.forward),
            "__doc__": f"A {base.__name__} whose loss coat computes fused with the LM head (coat.nn.causal_lm).",
            "__module__": __name__,
        },
    )


FUSED_LOSS_CAUSAL_LMS = {
    base: _fused_loss_class(base)
    for base in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
                 Olmo2ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM,
                 OlmoeForCausalLM, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
                 LlavaOnevisionForConditionalGeneration, Mistral3ForConditionalGeneration,
                 InternVLForConditionalGeneration, Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration,
                 Gemma3ForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                 Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration)
}
globals().update({cls.__name__: cls for cls in FUSED_LOSS_CAUSAL_LMS.values()})  # where pickle finds them


def install_fused_loss(model: nn.Module) -> bool:
    """Gives ``model`` the fused loss when it is one of the supported causal LMs with a plain nn.Linear head (an
    FP8 head from modules_to_convert keeps transformers' loss); returns whether it did."""
    fused_class = FUSED_LOSS_CAUSAL_LMS.get(type(model))
    head = getattr(model, "lm_head", None)
    if fused_class is None or type(head) is not nn.Linear:
        return False
    head.__class__ = FusedLossLMHead
    model.__class__ = fused_class
    return True
