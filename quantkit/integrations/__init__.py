"""quantkit's formats inside other tools' loaders (transformers' quantizer registry)."""
