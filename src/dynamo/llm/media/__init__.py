"""Images in requests: where they may come from (policy.py), fetching (fetch.py), decoding and hashing
(decode.py), finding and loading a request's images (load.py), and handing them to engines that take
the request as sent, as checked ``data:`` URLs (inline.py)."""

from dynamo.llm.media.decode import FORMATS, LoadedImage
from dynamo.llm.media.inline import image_uuid, inline_images
from dynamo.llm.media.load import check_image_count, image_parts, load_image, load_images
from dynamo.llm.media.policy import (
    ALLOW_INTERNAL_ENV,
    LIMIT_FLAG,
    LOCAL_PATH_ENV,
    LOCAL_PATH_FLAG,
    MediaError,
    MediaPolicy,
    current_policy,
    is_internal_address,
    parse_limit_mm_per_prompt,
    use_policy,
)

__all__ = [
    "ALLOW_INTERNAL_ENV", "FORMATS", "LIMIT_FLAG", "LOCAL_PATH_ENV", "LOCAL_PATH_FLAG", "LoadedImage", "MediaError",
    "MediaPolicy", "check_image_count", "current_policy", "image_parts", "image_uuid", "inline_images", "is_internal_address", "load_image",
    "load_images", "parse_limit_mm_per_prompt", "use_policy",
]
