"""kuberl: Kubernetes-native agentic reinforcement learning for LLMs (rStar2-Agent style)."""

__version__ = "0.1.0"
