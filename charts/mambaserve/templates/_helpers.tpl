{{/*
Names. Kubernetes object names and label values stop at 63 characters (DNS-1123 labels), so every
name is cut there and loses a trailing "-" the cut may leave. Suffixed names cut the base first so
the suffix survives: "<base cut to 63-len(suffix)>-<suffix>".
*/}}

{{- define "mambaserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mambaserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>" within 63 characters; call with (list $ "suffix"). */}}
{{- define "mambaserve.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "mambaserve.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{- define "mambaserve.operator.fullname" -}}
{{- include "mambaserve.suffixed" (list . "operator") -}}
{{- end -}}

{{- define "mambaserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mambaserve.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mambaserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (list $ "component"). */}}
{{- define "mambaserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "mambaserve.chart" $root }}
{{ include "mambaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/part-of: mambaserve
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Selector labels. The operator labels the pods it creates with app.kubernetes.io/name=mambaserve
and app.kubernetes.io/instance=<session name> too; the component keeps the two apart.
*/}}
{{- define "mambaserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "mambaserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/*
Images: "repository:tag", or pinned by digest: "repository:tag@sha256:..." with image.digest, or the
repository as given when it already names a digest ("registry/name@sha256:..."). values.schema.json
refuses an empty or `latest` tag and a malformed digest.
*/}}
{{- define "mambaserve.imageRef" -}}
{{- if contains "@sha256:" .repository -}}
{{- .repository -}}
{{- else if .digest -}}
{{- printf "%s:%s@%s" .repository .tag .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{- define "mambaserve.operator.image" -}}
{{- include "mambaserve.imageRef" .Values.operator.image -}}
{{- end -}}

{{- define "mambaserve.server.image" -}}
{{- include "mambaserve.imageRef" .Values.server.image -}}
{{- end -}}

{{/* Labels of monitoring objects: the chart's plus those a Prometheus selects on. */}}
{{- define "mambaserve.monitoringLabels" -}}
{{- $root := index . 0 -}}
{{ include "mambaserve.labels" . }}
{{- with $root.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The operator's API access, shared by the ClusterRole (cluster-wide mode) and the per-namespace
Roles (namespaced mode). Each rule is exactly what the code in operator/ does; tests/charts runs the
real operator and checks every request it makes against these rules.
*/}}
{{- define "mambaserve.operatorRules" -}}
# Kopf lists and watches the two kinds and patches their finalizers and progress annotations;
# the reconciler reads both from its own watch streams.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["mambaserve.io"]
  resources: ["cachetiers"]
  verbs: ["list", "watch", "patch"]
# Owner references with blockOwnerDeletion: where the OwnerReferencesPermissionEnforcement admission
# plugin is on (OpenShift), setting one needs update on the owner's finalizers subresource.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions/finalizers", "cachetiers/finalizers"]
  verbs: ["update"]
# Status is a subresource of both CRDs; the operator writes it and nothing else does.
- apiGroups: ["mambaserve.io"]
  resources: ["inferencesessions/status", "cachetiers/status"]
  verbs: ["patch"]
# Kopf posts Kubernetes events about the objects it handles.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Server pods are listed and watched (the operator's watch cache) to scrape their /metrics and to
# say why they do not serve, and patched to keep their controller.kubernetes.io/pod-deletion-cost
# annotation (scale-down removes the pods with the fewest open sessions first). get is not used by the
# operator itself: it needs it because the router Role it creates grants it, and RBAC only lets a
# subject grant permissions it holds (escalation prevention).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
# Children of an InferenceSession: read from watch streams selected by the operator's
# app.kubernetes.io/managed-by label (list, watch), server-side applied (patch; create when the
# apply creates the object), re-created when an immutable field changes and pruned when stale (delete). The optional kinds (KEDA, prometheus-operator)
# are watched whenever the cluster serves them, so they are always granted.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# Claims: a CacheTier's shared storage claim and a session's model cache. Watched, server-side
# applied (a bound claim's spec never changes: only labels may), deleted with their owner; model
# caches are pruned by label.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# The Job that downloads a session's model into its model cache claim (re-created on a new revision).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["list", "watch", "create", "patch", "delete"]
{{- end -}}

{{/*
Cluster-scoped reads Kopf makes in both modes: it watches CRDs so that CRDs upgraded outside Helm
(kubectl apply, see the chart README) are re-discovered without restarting the operator.
*/}}
{{- define "mambaserve.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{/*
"true" when the chart's PodMonitor scrapes the server pods: asked for, or implied by autoscaling.enabled
(autoscalers read the servers' series) unless the operator's per-session ServiceMonitors already do.
*/}}
{{- define "mambaserve.serverPodMonitor" -}}
{{- if or .Values.monitoring.serverPodMonitor.enabled (and .Values.autoscaling.enabled (not .Values.operator.serviceMonitors)) -}}
true
{{- end -}}
{{- end -}}

{{/*
The namespaces the operator watches, as a JSON list; [] means all of them (operator.clusterWide). By
default only the release's own namespace: least privilege unless asked for more.
*/}}
{{- define "mambaserve.watchNamespaces" -}}
{{- if .Values.operator.clusterWide -}}
{{- if .Values.operator.watchNamespaces -}}
{{- fail "operator.clusterWide watches every namespace: leave operator.watchNamespaces empty" -}}
{{- end -}}
[]
{{- else if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}
