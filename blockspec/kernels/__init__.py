"""One function per op. Each file holds the plain PyTorch reference (CPU, float32, used by every CI test)
and, beside it, the fast GPU path that replaces it when available."""
