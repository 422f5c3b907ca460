"""The engines a user would run instead of ours, measured on the same model, prompts and
token counts: a hand-written PyTorch decode (`torch_decode`), llama.cpp's own tools
(`llama_cpp`), and all of them beside ours in one run (`run_all`)."""
