"""The Kubernetes versions everything is validated against: the oldest the chart claims
(charts/mambaserve/Chart.yaml `kubeVersion`) and the newest whose official schemas the pinned
kubernetes-validate ships. tests/charts checks that the chart's claim starts at OLDEST."""

OLDEST = "1.28.0"
NEWEST = "1.37.0"
SUPPORTED = (OLDEST, NEWEST)
