// Entry point of audio.html: the full-duplex page with the microphone only.
import { startDuplexPage } from './duplex-page.js';

startDuplexPage({ mode: 'audio' });
