"""What the API server would refuse among the objects a resource creates.

``rendered_problems`` renders a resource exactly as the operator would (``builders.build_for``)
and runs the API server's own rules (``apirules``) over every child, recursing into the
RolloutFleet/SandboxPool a job declares inline (their Deployments and Services are children of
children). A manifest whose name is fine by itself can still give a Job whose pods' hostnames pass
63 characters, or a resources block the pod's API validation refuses. `kuberl validate`, the
operator's pre-flight and the admission webhook all call it, so each refuses such a resource
with the same words.
"""

from __future__ import annotations

from kuberl.api import ManifestError, Resource, SandboxPool, parse_resource
from kuberl.api.group import API_VERSION
from kuberl.api.rollout_fleet import RolloutFleetSpec
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.apirules import children_problems, restricted_problems


def rendered_problems(
    resource: Resource, namespace: str = "default", fleet: RolloutFleetSpec | None = None
) -> list[str]:
    """What the API server would refuse among the objects ``resource`` creates (empty: nothing)."""
    objs = build_for(resource, namespace, fleet=fleet)
    problems = children_problems(o for o in objs if o["apiVersion"] != API_VERSION)
    if isinstance(resource, SandboxPool):
        # Model-written code runs there: the pods stay within Pod Security "restricted".
        for obj in objs:
            if obj["kind"] == "Deployment":
                broken = restricted_problems(obj["spec"]["template"]["spec"])
                if broken:
                    problems.append(
                        f"Deployment/{obj['metadata']['name']}: sandbox pods must meet Pod Security "
                        f"\"restricted\" (spec.podTemplate breaks it): {'; '.join(broken)}"
                    )
    for obj in objs:
        if obj["apiVersion"] != API_VERSION:
            continue
        try:
            child = parse_resource(obj, source="rendered")
        except ManifestError as err:
            problems.append(str(err).removeprefix("rendered: "))
            continue
        problems += rendered_problems(child, namespace)
    return problems
