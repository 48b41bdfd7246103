{{- define "ipreclaim.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ipreclaim.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ipreclaim.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ipreclaim.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Cluster-scoped names carry the namespace: two releases of one name must not collide. */}}
{{- define "ipreclaim.clusterName" -}}
{{- printf "%s-%s" (include "ipreclaim.fullname" .root) .component -}}
{{- if ne .root.Release.Namespace "default" }}-{{ .root.Release.Namespace }}{{ end -}}
{{- end -}}

{{/* The ServiceAccount name of a component: .root, .component ("controller" or "node-agent"), .values. */}}
{{- define "ipreclaim.serviceAccountName" -}}
{{- .values.serviceAccount.name | default (printf "%s-%s" (include "ipreclaim.fullname" .root) .component) -}}
{{- end -}}

{{/* topologySpreadConstraints with the component's own pods as labelSelector where none is given. */}}
{{- define "ipreclaim.topologySpread" -}}
{{- $out := list }}
{{- range .constraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "ipreclaim.selector" (dict "root" $.root "component" $.component) | fromYaml)) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end -}}
