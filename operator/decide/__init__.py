"""kuberl.operator.decide: pure decisions on live state; imports ``decide`` and ``render`` only.

* ``autoscale``  -- autoscaling decisions and /metrics parsing;
* ``status``     -- phase and condition rules; ``conditions`` -- refused children and pods as
  status conditions and events;
* ``children``   -- rules on children that need the live state (orphans, inline replicas).
"""
