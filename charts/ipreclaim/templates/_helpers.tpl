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

{{/* Seconds in a humantime-style duration as the programs' flags take it (90s, 2m, 1h30m,
"1m 30s", 500ms); fails naming .what for anything else. */}}
{{- define "ipreclaim.seconds" -}}
{{- $d := .value | toString | trim -}}
{{- $units := dict "ms" 0.001 "msec" 0.001 "s" 1 "sec" 1 "secs" 1 "second" 1 "seconds" 1 "m" 60 "min" 60 "mins" 60 "minute" 60 "minutes" 60 "h" 3600 "hr" 3600 "hrs" 3600 "hour" 3600 "hours" 3600 "d" 86400 "day" 86400 "days" 86400 -}}
{{- $term := "[0-9]+(\\.[0-9]+)?\\s*[a-z]+" -}}
{{- if or (eq $d "") (ne (regexReplaceAll $term $d "" | nospace) "") -}}
{{- fail (printf "%s: %q is not a duration like 90s, 2m or 1h30m" .what $d) -}}
{{- end -}}
{{- $total := 0.0 -}}
{{- range regexFindAll $term $d -1 -}}
{{- $unit := regexFind "[a-z]+$" . -}}
{{- if not (hasKey $units $unit) -}}
{{- fail (printf "%s: unknown unit %q in %q" $.what $unit $d) -}}
{{- end -}}
{{- $total = addf $total (mulf (regexFind "^[0-9.]+" . | float64) (get $units $unit)) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* An alert's labels: its severity and prometheusRule.alertLabels (.p, .severity). */}}
{{- define "ipreclaim.alertLabels" -}}
severity: {{ .severity }}
{{- with .p.alertLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* An alert's runbook_url annotation, when prometheusRule.runbookUrl is set (.p, .alert). */}}
{{- define "ipreclaim.runbook" -}}
{{- with .p.runbookUrl -}}
runbook_url: {{ printf "%s#%s" . (lower $.alert) | quote }}
{{- end -}}
{{- end -}}
