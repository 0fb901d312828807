"""Published architectures (``configs``) and the attention swap (``patch``).

Both import transformers lazily through their functions; import the submodules explicitly
(``from fsalab.models import configs, patch``).
"""
