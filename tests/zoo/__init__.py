"""Model zoo: transformers' architectures from tiny configs, for conformance tests."""
