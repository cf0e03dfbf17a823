{{/* Labels on every object: the kustomize base's, plus Helm's own. */}}
{{- define "gpufrac.labels" -}}
app.kubernetes.io/name: gpu-fraction-plugin
app.kubernetes.io/part-of: gpu-fraction-device-plugin
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Cluster-scoped objects without the name label in the base (policy, classes). */}}
{{- define "gpufrac.partOf" -}}
app.kubernetes.io/part-of: gpu-fraction-device-plugin
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* "true" when any GPU is served through DRA: api, or a gpus entry's api. */}}
{{- define "gpufrac.dra" -}}
{{- $dra := eq .Values.api "dra" -}}
{{- range .Values.gpus }}{{ if eq (default "" .api) "dra" }}{{ $dra = true }}{{ end }}{{ end -}}
{{- if $dra }}true{{ end -}}
{{- end -}}

{{/* The plugin's config file: version, api, gpus, the GPU Operator's paths, then `config`. */}}
{{- define "gpufrac.config" -}}
{{- $cfg := dict "version" "v1" -}}
{{- if ne .Values.api "device-plugin" }}{{ $_ := set $cfg "api" .Values.api }}{{ end -}}
{{- if .Values.gpus }}{{ $_ := set $cfg "gpus" .Values.gpus }}{{ end -}}
{{- if .Values.gpuOperator -}}
{{- $_ := set $cfg "cdi" (dict "nvidiaCtkPath" "/usr/local/nvidia/toolkit/nvidia-ctk" "driverRoot" "/run/nvidia/driver" "devRoot" "/") -}}
{{- $_ := set $cfg "mps" (dict "hostBinary" "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control") -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $cfg (deepCopy .Values.config)) -}}
{{- end -}}

{{/* An agent policy's name, from (list $ "suffix"): the kustomize name for the default
release, the release's own otherwise (a second release is a second identity, with its own
policies). */}}
{{- define "gpufrac.policy" -}}
{{- $root := index . 0 -}}
{{- if eq $root.Values.name "gpu-fraction-plugin" }}gpu-fraction-{{ index . 1 }}{{ else }}{{ $root.Values.name }}-{{ index . 1 }}{{ end -}}
{{- end -}}
