"""Checkpoint parameter names -> composer's Wan DiT names, as data (ordered regex rules, applied in turn).

composer names differ from diffusers only where diffusers' names carry its module plumbing
(`to_out.0`, `ffn.net.0.proj`). The original Wan release uses its own names (`self_attn.q`, `modulation`,
`head.head`) and calls the cross-attention norm `norm3`.
"""

from __future__ import annotations

DIFFUSERS_TO_COMPOSER: list[tuple[str, str]] = [
    (r"\.to_out\.0\.", ".to_out."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.fc_in."),
    (r"\.ffn\.net\.2\.", ".ffn.fc_out."),
    (r"\.image_embedder\.ff\.net\.0\.proj\.", ".image_embedder.ff.fc_in."),  # I2V / FLF2V image embedder
    (r"\.image_embedder\.ff\.net\.2\.", ".image_embedder.ff.fc_out."),
]

ORIGINAL_TO_COMPOSER: list[tuple[str, str]] = [
    (r"^model\.diffusion_model\.", ""),  # ComfyUI-style prefix
    (r"^time_embedding\.0\.", "condition_embedder.time_embedder.linear_1."),
    (r"^time_embedding\.2\.", "condition_embedder.time_embedder.linear_2."),
    (r"^text_embedding\.0\.", "condition_embedder.text_embedder.linear_1."),
    (r"^text_embedding\.2\.", "condition_embedder.text_embedder.linear_2."),
    (r"^time_projection\.1\.", "condition_embedder.time_proj."),
    (r"\.self_attn\.", ".attn1."),
    (r"\.cross_attn\.", ".attn2."),
    (r"\.attn([12])\.([qkv])\.", r".attn\1.to_\2."),
    (r"\.attn([12])\.o\.", r".attn\1.to_out."),
    (r"^blocks\.(\d+)\.norm3\.", r"blocks.\1.norm2."),
    (r"^blocks\.(\d+)\.modulation$", r"blocks.\1.scale_shift_table"),
    (r"\.ffn\.0\.", ".ffn.fc_in."),
    (r"\.ffn\.2\.", ".ffn.fc_out."),
    (r"^head\.head\.", "proj_out."),
    (r"^head\.modulation$", "scale_shift_table"),
    # I2V / FLF2V: the image tokens' k/v in cross-attention, the image embedder (LN, Linear, GELU, Linear, LN)
    (r"\.attn2\.k_img\.", ".attn2.add_k_proj."),
    (r"\.attn2\.v_img\.", ".attn2.add_v_proj."),
    (r"\.attn2\.norm_k_img\.", ".attn2.norm_added_k."),
    (r"^img_emb\.proj\.0\.", "condition_embedder.image_embedder.norm1."),
    (r"^img_emb\.proj\.1\.", "condition_embedder.image_embedder.ff.fc_in."),
    (r"^img_emb\.proj\.3\.", "condition_embedder.image_embedder.ff.fc_out."),
    (r"^img_emb\.proj\.4\.", "condition_embedder.image_embedder.norm2."),
    (r"^img_emb\.emb_pos$", "condition_embedder.image_embedder.pos_embed"),
]

# composer naming -> diffusers naming (the inverse of DIFFUSERS_TO_COMPOSER), for writing diffusers folders.
COMPOSER_TO_DIFFUSERS: list[tuple[str, str]] = [
    (r"\.to_out\.", ".to_out.0."),
    (r"\.ffn\.fc_in\.", ".ffn.net.0.proj."),
    (r"\.ffn\.fc_out\.", ".ffn.net.2."),
    (r"\.image_embedder\.ff\.fc_in\.", ".image_embedder.ff.net.0.proj."),
    (r"\.image_embedder\.ff\.fc_out\.", ".image_embedder.ff.net.2."),
]
