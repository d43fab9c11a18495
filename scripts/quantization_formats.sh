# The quantization reports' formats, sourced by quantization_report.sh and quantization_paired.sh once
# they have set default_dtype (the CPU's default: bfloat16 or float32).

# format_settings NAME: the tgis server setting of a format (float32, default, int8, int4).
format_settings() {
    case $1 in
        float32) echo "DTYPE=float32" ;;
        default) echo "DTYPE=$default_dtype" ;;
        int8) echo "QUANTIZE=int8" ;;
        int4) echo "QUANTIZE=int4" ;;
        *) echo "unknown format $1 (float32, default, int8, int4)" >&2; return 1 ;;
    esac
}

# format_ggufs NAME: the llama.cpp GGUF types beside a format, its own first (Q4_K_M is int4's second).
format_ggufs() {
    case $1 in
        float32) echo f32 ;;
        default) [[ $default_dtype == bfloat16 ]] && echo bf16 || echo f32 ;;
        int8) echo q8_0 ;;
        int4) echo "q4_0 q4_k_m" ;;
        *) echo "unknown format $1 (float32, default, int8, int4)" >&2; return 1 ;;
    esac
}

# check_formats NAME...: fails, naming what works, on the first name that is not a format, before a
# script starts any server.
check_formats() {
    local format
    for format in "$@"; do
        format_settings "$format" >/dev/null || return 1
    done
}
