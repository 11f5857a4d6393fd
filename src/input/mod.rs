//! Readers of pack inputs (NumPy .npy and safetensors).
