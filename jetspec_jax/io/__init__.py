"""Files in and out: conversion from HF and GGUF, our checkpoints, the reference's draft-head
format, tokenizers, and loading a target or a head from any of them."""
